"""What an engine is asked to do, as plain values: ``EngineSettings`` with its parts
(``DDPSettings``, ``FSDPSettings``, ``PipelineSettings``, ``MeshSettings``) and the AMP level
(``AmpSettings``). Each option is declared once (``pycls.options.option``): the config's
TRAIN.PARALLEL, TRAIN.COMPILE*, DDP.*, FSDP.*, PIPELINE.*, MESH.* and AMP.* keys are generated
from these fields (``pycls.config.sections.engine`` and ``amp``), which the builders fill, so the
engines never see the config itself. Plain Python, no torch: the config reads the values here.
"""

from dataclasses import dataclass

from pycls.distributed.launch_settings import ENGINE_OF_KEYS, engine_of
from pycls.options import Feature, Key, NoKey, ReadFrom, option

# The engines (the keys of pycls.engines.support.ENGINES) and TRAIN.PARALLEL's values: each engine
# but "fairscale", which is fsdp with FSDP.BACKEND fairscale
ENGINES = ("none", "ddp", "fsdp", "fairscale", "pipeline", "tensor")
PARALLEL = tuple(name for name in ENGINES if name != "fairscale")
FSDP_BACKENDS = ("torch", "fairscale")
COMPILE_SCOPES = ("blocks", "model")
# torch.compile's modes (torch._inductor.list_mode_options() lists what each sets)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PIPELINE_BALANCES = ("blocks", "params")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# The AMP levels (pycls.engines.precision), their half types, and the type gradients are averaged in
AMP_LEVELS = ("O0", "O1", "O2", "O3")
AMP_DTYPES = ("bfloat16", "float16")
REDUCE_DTYPES = ("float32", "compute")
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
FLOAT8_LAYER_CHOICES = ("all", "mlp", "auto")

_PART = "a record of its own, with its own keys"


@dataclass(frozen=True)
class DDPSettings:
    """torch's DistributedDataParallel options (the DDP keys)."""

    bucket_cap_mb: float = option(
        25,
        "Size of a gradient all-reduce bucket in MiB (buckets are reduced while the backward "
        "continues)",
        bounds="positive",
    )
    gradient_as_bucket_view: bool = option(
        False,
        "Gradients are views into the reduction buckets (saves a copy and the memory of one "
        "gradient)",
    )
    static_graph: bool = option(
        False,
        "The set of used parameters and the order of their gradients never change between steps: "
        "lets DDP skip per-step bookkeeping (and combine with activation checkpointing)",
    )
    find_unused_parameters: bool = option(
        False,
        "Look for parameters the forward did not use, every step (slower; needed only if some "
        "parameters get no gradient)",
    )


@dataclass(frozen=True)
class FSDPSettings:
    """Sharding options (the FSDP keys; FSDP.BACKEND picks the engine: ``engine_of``)."""

    reshard_after_forward: bool = option(
        True,
        "Free each block's gathered parameters after its forward and gather them again for the "
        "backward (less memory); False keeps them from the forward to the backward (less "
        "communication)",
    )
    cpu_offload: bool = option(
        False,
        "Keep the sharded parameters, gradients and optimizer state in host memory; the optimizer "
        "then steps on the CPU (torch: CPUOffloadPolicy; fairscale: move_params_to_cpu)",
    )


@dataclass(frozen=True)
class PipelineSettings:
    """The pipeline's cut and schedule (the PIPELINE keys)."""

    stages: int = option(
        2,
        "Pipeline ranks: the ViT's blocks are spread over this many processes; the processes are "
        "STAGES x replicas, the replicas being data-parallel (DDP over the same stage)",
        bounds="positive",
    )
    stages_per_rank: int = option(
        1,
        "Model chunks per pipeline rank (virtual stages): 1 for gpipe and 1f1b, 2 or more for "
        "interleaved_1f1b; the ViT is cut into STAGES x STAGES_PER_RANK chunks (at most "
        "VIT.DEPTH)",
        bounds="positive",
    )
    balance: str = option(
        "blocks",
        "How chunks are balanced: blocks (equal block counts) or params (equal parameter counts, "
        "the embedding counted in the first chunk and the head in the last)",
        choices=PIPELINE_BALANCES,
    )
    micro_batches: int = option(
        4,
        "Micro-batches per step; the batch per replica (TRAIN.BATCH_SIZE / replicas) must split "
        "into them",
        bounds="positive",
    )
    schedule: str = option(
        "1f1b",
        "Schedule: gpipe (all forwards, then all backwards), 1f1b (one forward one backward: "
        "fewer activations alive) or interleaved_1f1b (1F1B over several chunks per rank: smaller "
        "bubble)",
        choices=PIPELINE_SCHEDULES,
    )


@dataclass(frozen=True)
class MeshSettings:
    """The device mesh of TRAIN.PARALLEL tensor (the MESH keys), and the batch that sizes the
    communication estimate every engine logs at start."""

    dp: int = option(
        0,
        "Data-parallel replicas, over which FSDP2 shards each process's part of the model (FSDP.* "
        "apply) or, with MESH.PP > 1, which average the gradients of each stage; 0 = the "
        "processes left over (processes / (TP x PP)). DP x TP x PP must be the number of processes",
        bounds="non_negative",
    )
    dp_replicate: int = option(
        0,
        "FSDP2 replicas (HSDP: hybrid sharding), under TRAIN.PARALLEL fsdp (FSDP.BACKEND torch) "
        "and tensor: the data-parallel processes (all of them under fsdp, MESH.DP under tensor) "
        "form DP_REPLICATE groups of consecutive ranks; FSDP2 shards parameters, gradients and "
        "optimizer state within a group (its all-gathers and reduce-scatters stay there) and the "
        "groups average their gradient shards with one all-reduce per step. 0 = one group per "
        "machine where the launcher says how many (torchrun's LOCAL_WORLD_SIZE, srun's tasks per "
        "node, the same on every machine, whole MESH.TP groups on each), else 1; 1 = shard over "
        "every data-parallel process (plain FSDP2). Must divide the data-parallel processes; not "
        "with MESH.PP > 1 (no FSDP2 there)",
        bounds="non_negative",
    )
    tp: int = option(
        1,
        "Tensor-parallel processes per model replica: each block's attention heads and MLP hidden "
        "channels are split over them (qkv and fc1 column-wise, proj and fc2 row-wise) and its "
        "LayerNorms, dropouts and residual stream over the tokens (sequence parallelism); the "
        "embedding and the classifier are replicated. Must divide VIT.NUM_HEADS and VIT.MLP_DIM",
        bounds="positive",
    )
    pp: int = option(
        1,
        "Pipeline stages, cut and scheduled as PIPELINE.* say (PIPELINE.STAGES itself is the "
        "pipeline engine's key: here MESH.PP is)",
        bounds="positive",
    )
    batch_size: int = option(
        0,
        "Images per optimizer step over all processes (0: no communication estimate)",
        key=ReadFrom("TRAIN.BATCH_SIZE"),
    )
    accum_steps: int = option(1, "Micro-batches per step", key=ReadFrom("TRAIN.ACCUM_STEPS"))


@dataclass(frozen=True)
class EngineSettings:
    """Which engine holds the model and how; its parts are records of their own (DDP, FSDP,
    PIPELINE and MESH keys). torch.compile's options are ``pycls.engines.base.compile_kwargs``'s,
    float8's ``pycls.engines.float8``'s."""

    engine: str = option(
        "none",
        "Parallelism: none, ddp, fsdp, pipeline or tensor (tensor and sequence parallelism over a "
        "device mesh, with FSDP2 and pipeline stages: MESH.*)",
        choices=ENGINES,
        key=Key(
            "PARALLEL",
            choices=PARALLEL,
            read=engine_of,
            also_reads=ENGINE_OF_KEYS[1:],
            why="the run's parallelism, whose value names the engine but for fsdp with "
            "FSDP.BACKEND fairscale (FairScale's engine)",
        ),
    )
    compile: bool = option(False, "Compile the model with torch.compile", feature="compile")
    compile_scope: str = option(
        "blocks",
        "What TRAIN.COMPILE compiles: blocks (each transformer or residual block in place, "
        "regional compilation: blocks of one shape share one compiled graph, so compiling takes a "
        "fraction of the time) or model (the whole model as one graph)",
        choices=COMPILE_SCOPES,
        feature=Feature("whole-model compile", lambda a: a.compile and a.compile_scope == "model"),
    )
    compile_mode: str = option(
        "default",
        "torch.compile's mode where TRAIN.COMPILE compiles (blocks or the whole model): default, "
        "max-autotune-no-cudagraphs (inductor benchmarks matmul and kernel variants while "
        "compiling: minutes for a ViT), max-autotune (the same with CUDA graphs) or "
        "reduce-overhead (CUDA graphs); torch._inductor.list_mode_options() lists what each sets",
        choices=COMPILE_MODES,
    )
    compile_coordinate_descent: bool = option(
        False,
        "Inductor's coordinate-descent tuning of each generated kernel's launch parameters (block "
        "sizes, warps) where TRAIN.COMPILE compiles: longer compiles, sometimes faster "
        "element-wise and reduction kernels (on the mode's options; max-autotune modes already "
        "turn it on)",
    )
    reduce_in_compute_dtype: bool = option(
        False,
        "Type in which the processes average their gradients, the same under every engine: "
        "float32 (half gradients are summed in fp32 and rounded once) or compute (in AMP.DTYPE: "
        "half the traffic, a rounding per addition)",
        key=Key(
            "REDUCE_DTYPE",
            group="AMP",
            owner="amp",
            default="float32",
            choices=REDUCE_DTYPES,
            read=lambda dtype: dtype == "compute",
            why="the key names the type; the engine asks whether it is the compute type",
        ),
    )
    sync_batch_norm: bool = option(
        False,
        "Under TRAIN.PARALLEL ddp: normalise with the statistics of the whole global batch "
        "(torch.nn.SyncBatchNorm) instead of each process's share (upstream's behaviour, False). "
        "CUDA only: PyTorch's SyncBatchNorm has no CPU kernel. One process (TRAIN.PARALLEL none) "
        "ignores it",
        key=Key("SYNC", group="BN", owner="model_cnn", why="the batch norms' group, BN"),
        feature="SyncBatchNorm",
    )
    float8: str = option(
        "none",
        "float8 linear layers through torchao (pip install torchao): none, tensorwise (one scale "
        "per tensor; under FSDP2 the weights are all-gathered in float8) or rowwise (one scale per "
        "row: closer to bfloat16, more casting). Only the linear layers whose in and out features "
        "are both at least FLOAT8_MIN_DIM (and multiples of 16) are converted, the heads never; "
        "the log lists them. Needs float8 matmuls (NVIDIA compute capability 8.9+: Ada, Hopper, "
        "Blackwell): refused elsewhere. Weights and checkpoints stay as they are (fp32, or "
        "AMP.LEVEL's half type)",
        choices=FLOAT8_RECIPES,
        key=Key(group="AMP", owner="amp"),
        feature="float8",
    )
    float8_min_dim: int = option(
        2048,
        "The smallest side a linear layer needs to be converted to float8. torchao's H100 "
        "microbenchmarks: a (1024 x 2048) x (2048 x 1024) matmul runs at 0.80x of bfloat16, a "
        "(4096 x 8192) x (8192 x 16384) one at 1.39x, so small layers stay in bfloat16; 2048 lies "
        "between the two. Every ViT in configs/ (width 192-1280, MLP 768-5120) is below it: 0 "
        "converts all their blocks' layers (docs/float8.md)",
        bounds="non_negative",
        key=Key(group="AMP", owner="amp"),
    )
    float8_layers: str = option(
        "all",
        "Which of the layers FLOAT8_MIN_DIM allows are converted (FLOAT8_MIN_DIM filters first, "
        "then this key picks among what is left): all (every one: what ran before the key "
        "existed), mlp (each block's ffn.fc1 and ffn.fc2 only) or auto (where a roofline of the "
        "float8 matmul's saving against its casts' memory traffic, at one process's micro-batch x "
        "tokens rows, expects a gain; its constants are H100 estimates, "
        "pycls.engines.float8.float8_gain). mlp and auto act on the ViT's blocks; set "
        "FLOAT8_MIN_DIM 0 to let them choose among all of them (docs/float8.md)",
        choices=FLOAT8_LAYER_CHOICES,
        key=Key(group="AMP", owner="amp"),
    )
    float8_micro_batch: int = option(
        0,
        "Images per process and micro-batch, which float8_layers auto weighs",
        key=NoKey("the builders count it for the run's processes"),
    )
    # The parts: frozen records, so one default instance is shared safely
    ddp: DDPSettings = option(DDPSettings(), "DDP's options", key=NoKey(_PART))
    fsdp: FSDPSettings = option(FSDPSettings(), "FSDP's options", key=NoKey(_PART))
    pipeline: PipelineSettings = option(PipelineSettings(), "The pipeline's", key=NoKey(_PART))
    mesh: MeshSettings = option(MeshSettings(), "The device mesh", key=NoKey(_PART))


@dataclass(frozen=True)
class AmpSettings:
    """The AMP level and its half type (``pycls.engines.precision.Precision``; the AMP keys)."""

    level: str = option(
        "O0",
        "Precision level: O0 fp32; O1 autocast; O2 half weights (fp32 norms) + fp32 master "
        "weights; O3 everything in half precision",
        choices=AMP_LEVELS,
        feature=Feature("AMP", lambda a: a.level != "O0"),
    )
    dtype: str = option(
        "bfloat16",
        "Half-precision type for O1-O3: bfloat16 or float16 (float16 uses dynamic loss scaling)",
        choices=AMP_DTYPES,
    )
