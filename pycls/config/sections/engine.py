"""How a run is spread over devices and processes: the engine (TRAIN.PARALLEL and its settings
DDP, FSDP, PIPELINE, MESH), compilation (TRAIN.COMPILE), the device and the processes (DEVICE,
NUM_PROCS, CPU_THREADS); docs/distributed.md, docs/tensor_parallel.md. What the keys become: the
engine's settings (``ENGINE_SETTINGS`` and its parts, ``pycls.engines.settings``) and the
launcher's (``LAUNCH_SETTINGS``, ``pycls.distributed.preflight.LaunchSettings``). Which feature
works with which engine is the rule of ``pycls.engines.support``, over every section's FEATURES.
"""

import math

from pycls.config.sections.key_checks import CfgNode, get, require
from pycls.distributed.mesh_layout import mesh_shape, replica_shape
from pycls.models.vit.args import ffn_hidden_width, tp_divisors

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.TRAIN = CfgNode()
_C.FSDP = CfgNode()
_C.PIPELINE = CfgNode()
_C.MESH = CfgNode()
_C.DDP = CfgNode()

# Parallelism: "none", "ddp", "fsdp", "pipeline" or "tensor" (tensor and sequence parallelism over
# a device mesh, with FSDP2 and pipeline stages: MESH.*)
_C.TRAIN.PARALLEL = "none"

# Compile the model with torch.compile
_C.TRAIN.COMPILE = False

# What TRAIN.COMPILE compiles: "blocks" (each transformer or residual block in place, regional
# compilation: blocks of one shape share one compiled graph, so compiling takes a fraction of the
# time) or "model" (the whole model as one graph)
_C.TRAIN.COMPILE_SCOPE = "blocks"

# torch.compile's mode where TRAIN.COMPILE compiles (blocks or the whole model): "default",
# "max-autotune-no-cudagraphs" (inductor benchmarks matmul and kernel variants while compiling:
# minutes for a ViT), "max-autotune" (the same with CUDA graphs) or "reduce-overhead" (CUDA
# graphs); torch._inductor.list_mode_options() lists what each sets
_C.TRAIN.COMPILE_MODE = "default"

# Inductor's coordinate-descent tuning of each generated kernel's launch parameters (block sizes,
# warps) where TRAIN.COMPILE compiles: longer compiles, sometimes faster element-wise and
# reduction kernels (on the mode's options; max-autotune modes already turn it on)
_C.TRAIN.COMPILE_COORDINATE_DESCENT = False

# Engine: "torch" (FSDP2, fully_shard per transformer block and on the root; CPU or CUDA) or
# "fairscale" (FairScale FullyShardedDataParallel per block; CUDA only)
_C.FSDP.BACKEND = "torch"

# Free each block's gathered parameters after its forward and gather them again for the backward
# (less memory); False keeps them from the forward to the backward (less communication)
_C.FSDP.RESHARD_AFTER_FORWARD = True

# Keep the sharded parameters, gradients and optimizer state in host memory; the optimizer then
# steps on the CPU (torch: CPUOffloadPolicy; fairscale: move_params_to_cpu)
_C.FSDP.CPU_OFFLOAD = False

# Pipeline ranks: the ViT's blocks are spread over this many processes; the processes are
# STAGES x replicas, the replicas being data-parallel (DDP over the same stage)
_C.PIPELINE.STAGES = 2

# Model chunks per pipeline rank (virtual stages): 1 for gpipe and 1f1b, 2 or more for
# interleaved_1f1b; the ViT is cut into STAGES x STAGES_PER_RANK chunks (at most VIT.DEPTH)
_C.PIPELINE.STAGES_PER_RANK = 1

# How chunks are balanced: "blocks" (equal block counts) or "params" (equal parameter counts, the
# embedding counted in the first chunk and the head in the last)
_C.PIPELINE.BALANCE = "blocks"

# Micro-batches per step; the batch per replica (TRAIN.BATCH_SIZE / replicas) must split into them
_C.PIPELINE.MICRO_BATCHES = 4

# Schedule: "gpipe" (all forwards, then all backwards), "1f1b" (one forward one backward: fewer
# activations alive) or "interleaved_1f1b" (1F1B over several chunks per rank: smaller bubble)
_C.PIPELINE.SCHEDULE = "1f1b"

# Tensor-parallel processes per model replica: each block's attention heads and MLP hidden
# channels are split over them (qkv and fc1 column-wise, proj and fc2 row-wise) and its
# LayerNorms, dropouts and residual stream over the tokens (sequence parallelism); the embedding
# and the classifier are replicated. Must divide VIT.NUM_HEADS and VIT.MLP_DIM
_C.MESH.TP = 1

# Pipeline stages, cut and scheduled as PIPELINE.* say (PIPELINE.STAGES itself is the pipeline
# engine's key: here MESH.PP is)
_C.MESH.PP = 1

# Data-parallel replicas, over which FSDP2 shards each process's part of the model (FSDP.* apply)
# or, with MESH.PP > 1, which average the gradients of each stage; 0 = the processes left over
# (processes / (TP x PP)). DP x TP x PP must be the number of processes
_C.MESH.DP = 0

# FSDP2 replicas (HSDP: hybrid sharding), under TRAIN.PARALLEL fsdp (FSDP.BACKEND torch) and
# tensor: the data-parallel processes (all of them under fsdp, MESH.DP under tensor) form
# DP_REPLICATE groups of consecutive ranks; FSDP2 shards parameters, gradients and optimizer state
# within a group (its all-gathers and reduce-scatters stay there) and the groups average their
# gradient shards with one all-reduce per step. 0 = one group per machine where the launcher says
# how many (torchrun's LOCAL_WORLD_SIZE, srun's tasks per node, the same on every machine, whole
# MESH.TP groups on each), else 1; 1 = shard over every data-parallel process (plain FSDP2). Must
# divide the data-parallel processes; not with MESH.PP > 1 (no FSDP2 there)
_C.MESH.DP_REPLICATE = 0

# Size of a gradient all-reduce bucket in MiB (buckets are reduced while the backward continues)
_C.DDP.BUCKET_CAP_MB = 25

# Gradients are views into the reduction buckets (saves a copy and the memory of one gradient)
_C.DDP.GRADIENT_AS_BUCKET_VIEW = False

# The set of used parameters and the order of their gradients never change between steps: lets
# DDP skip per-step bookkeeping (and combine with activation checkpointing)
_C.DDP.STATIC_GRAPH = False

# Look for parameters the forward did not use, every step (slower; needed only if some parameters
# get no gradient)
_C.DDP.FIND_UNUSED_PARAMETERS = False

# Device: "auto" (cuda when available, else cpu), "cpu" or "cuda"
_C.DEVICE = "auto"

# Number of local processes to spawn (1 = this process only)
_C.NUM_PROCS = 1

# CPU threads of each process (torch.set_num_threads). 0 = automatic: OMP_NUM_THREADS if set,
# else a SLURM task's SLURM_CPUS_PER_TASK, else for a process started beside others (torchrun,
# srun, NUM_PROCS) the CPUs of its affinity mask divided by the processes on the machine; a plain
# single process keeps torch's default (one thread per core)
_C.CPU_THREADS = 0


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {
    "TRAIN.PARALLEL": ("none", "ddp", "fsdp", "pipeline", "tensor"),
    "TRAIN.COMPILE_SCOPE": ("blocks", "model"),
    "TRAIN.COMPILE_MODE": (
        "default",
        "reduce-overhead",
        "max-autotune",
        "max-autotune-no-cudagraphs",
    ),
    "FSDP.BACKEND": ("torch", "fairscale"),
    "PIPELINE.BALANCE": ("blocks", "params"),
    "PIPELINE.SCHEDULE": ("gpipe", "1f1b", "interleaved_1f1b"),
    "DEVICE": ("auto", "cpu", "cuda"),
}
POSITIVE = [
    "NUM_PROCS",
    "DDP.BUCKET_CAP_MB",
    "PIPELINE.STAGES",
    "PIPELINE.STAGES_PER_RANK",
    "PIPELINE.MICRO_BATCHES",
    "MESH.TP",
    "MESH.PP",
]
NON_NEGATIVE = ["MESH.DP", "MESH.DP_REPLICATE", "CPU_THREADS"]


def engine_name(c):
    """The engine the config selects (a key of pycls.engines.support.ENGINES)."""
    if c.TRAIN.PARALLEL == "fsdp" and c.FSDP.BACKEND == "fairscale":
        return "fairscale"
    return c.TRAIN.PARALLEL


def check(c):
    """How TRAIN.COMPILE compiles needs TRAIN.COMPILE; MESH.*: only under TRAIN.PARALLEL tensor
    (MESH.DP_REPLICATE under fsdp too: ``_check_replicas``); TP must divide the heads and the MLP
    width, and the mesh the processes when their number is known now (NUM_PROCS; a launcher's
    processes are checked at launch: pycls.distributed.preflight)."""
    check_compile_options(c)
    _check_replicas(c)
    m = c.MESH
    if c.TRAIN.PARALLEL != "tensor":
        for key, default in (("MESH.TP", 1), ("MESH.PP", 1), ("MESH.DP", 0)):
            require(
                get(c, key) == default,
                key,
                f"{get(c, key)} describes the device mesh of TRAIN.PARALLEL tensor, not of "
                f"TRAIN.PARALLEL {c.TRAIN.PARALLEL}",
            )
        return
    if c.MODEL.TYPE != "vit":
        return  # the engine x feature rule names the CNN families
    _check_vit_mesh(c)
    stages = c.PIPELINE.STAGES
    require(
        stages in (_C.PIPELINE.STAGES, m.PP),
        "PIPELINE.STAGES",
        f"{stages}: under TRAIN.PARALLEL tensor the pipeline's stages are MESH.PP ({m.PP}); set "
        f"MESH.PP {stages} instead",
    )
    require(
        not c.FSDP.CPU_OFFLOAD,
        "FSDP.CPU_OFFLOAD",
        "is untested with TRAIN.PARALLEL tensor (host-resident shards of tensor-parallel parts); "
        "set it False",
    )
    require(
        m.PP == 1 or c.FSDP.RESHARD_AFTER_FORWARD == _C.FSDP.RESHARD_AFTER_FORWARD,
        "FSDP.RESHARD_AFTER_FORWARD",
        "applies to FSDP2, which MESH.PP > 1 does not run (the replicas of a stage average its "
        "gradients); leave it at its default",
    )
    if c.NUM_PROCS > 1:
        mesh_shape(c.NUM_PROCS, m.DP, m.TP, m.PP)


def _selected(c):
    """The engine the config selects, in the keys' words."""
    if engine_name(c) == "fairscale":
        return "TRAIN.PARALLEL fsdp with FSDP.BACKEND fairscale"
    return f"TRAIN.PARALLEL {c.TRAIN.PARALLEL}"


def _check_replicas(c):
    """MESH.DP_REPLICATE: FSDP2's replicas, under the engines that run FSDP2 (fsdp with the torch
    backend, tensor without pipeline stages), dividing the data-parallel processes where their
    number is known (MESH.DP, or NUM_PROCS; a launcher's processes are checked at launch)."""
    m, replicate = c.MESH, c.MESH.DP_REPLICATE
    if replicate == _C.MESH.DP_REPLICATE:
        return
    engine = engine_name(c)
    require(
        engine in ("fsdp", "tensor"),
        "MESH.DP_REPLICATE",
        f"{replicate}: replicas of FSDP2's shards, which TRAIN.PARALLEL fsdp (FSDP.BACKEND torch) "
        f"and tensor have and {_selected(c)} has not; leave it at 0",
    )
    require(
        engine != "tensor" or m.PP == 1 or replicate == 1,
        "MESH.DP_REPLICATE",
        f"{replicate}: with MESH.PP {m.PP} the replicas of a stage average its gradients without "
        "FSDP2, so there is nothing to shard within a replica; set it 0 or 1",
    )
    dp = 0
    if engine == "tensor":
        known = c.NUM_PROCS > 1 and c.NUM_PROCS % (m.TP * m.PP) == 0
        dp = m.DP or (c.NUM_PROCS // (m.TP * m.PP) if known else 0)
    elif c.NUM_PROCS > 1:
        dp = c.NUM_PROCS
    if dp:
        replica_shape(dp, replicate)


def check_compile_options(c):
    """What torch.compile is asked to do needs TRAIN.COMPILE (nothing else compiles the model)."""
    for key in ("TRAIN.COMPILE_MODE", "TRAIN.COMPILE_COORDINATE_DESCENT"):
        require(
            c.TRAIN.COMPILE or get(c, key) == get(_C, key),
            key,
            f"{get(c, key)} says how TRAIN.COMPILE compiles, but TRAIN.COMPILE is False: set it "
            "True, or leave this key at its default",
        )


def _check_vit_mesh(c):
    """The ViT's heads and feed-forward width split over MESH.TP, its blocks over the chunks."""
    m, v = c.MESH, c.VIT
    hidden = ffn_hidden_width(v.MLP_DIM, v.FFN_WIDTH, v.FFN_ALIGN)
    width = f"VIT.MLP_DIM={v.MLP_DIM}"
    if hidden != v.MLP_DIM:
        width += f" (the feed-forward's {hidden} with VIT.FFN_WIDTH {v.FFN_WIDTH}, VIT.FFN_ALIGN "
        width += f"{v.FFN_ALIGN})"
    for what, n in ((f"VIT.NUM_HEADS={v.NUM_HEADS}", v.NUM_HEADS), (width, hidden)):
        require(
            n % m.TP == 0,
            "MESH.TP",
            f"{m.TP} does not divide {what} (each process holds an equal share of the heads "
            "and of the hidden channels); values that divide the heads and the hidden width: "
            f"{tp_divisors(math.gcd(v.NUM_HEADS, hidden))}",
        )
    chunks = m.PP * c.PIPELINE.STAGES_PER_RANK
    require(
        m.PP == 1 or chunks <= v.DEPTH,
        "MESH.PP",
        f"{m.PP} stages x PIPELINE.STAGES_PER_RANK {c.PIPELINE.STAGES_PER_RANK} = {chunks} "
        f"chunks, more than the {v.DEPTH} blocks of VIT.DEPTH (every chunk needs a block)",
    )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    "compile": ("TRAIN.COMPILE", lambda c: c.TRAIN.COMPILE),
    "whole-model compile": (
        "TRAIN.COMPILE_SCOPE",
        lambda c: c.TRAIN.COMPILE and c.TRAIN.COMPILE_SCOPE == "model",
    ),
}


# ------------------------------------------------------------------------------------------------ #
# What the keys become: pycls.engines.settings.EngineSettings (its parts DDPSettings,
# FSDPSettings, PipelineSettings, MeshSettings) and pycls.distributed.preflight.LaunchSettings
# ------------------------------------------------------------------------------------------------ #
ENGINE_SETTINGS = {
    "engine": engine_name,
    "compile": lambda c: c.TRAIN.COMPILE,
    "compile_scope": lambda c: c.TRAIN.COMPILE_SCOPE,
    "compile_mode": lambda c: c.TRAIN.COMPILE_MODE,
    "compile_coordinate_descent": lambda c: c.TRAIN.COMPILE_COORDINATE_DESCENT,
    "reduce_in_compute_dtype": lambda c: c.AMP.REDUCE_DTYPE == "compute",
    "sync_batch_norm": lambda c: c.BN.SYNC,
    "float8": lambda c: c.AMP.FLOAT8,
    "float8_min_dim": lambda c: c.AMP.FLOAT8_MIN_DIM,
    "float8_layers": lambda c: c.AMP.FLOAT8_LAYERS,
}
DDP_SETTINGS = {
    "bucket_cap_mb": lambda c: c.DDP.BUCKET_CAP_MB,
    "gradient_as_bucket_view": lambda c: c.DDP.GRADIENT_AS_BUCKET_VIEW,
    "static_graph": lambda c: c.DDP.STATIC_GRAPH,
    "find_unused_parameters": lambda c: c.DDP.FIND_UNUSED_PARAMETERS,
}
FSDP_SETTINGS = {
    "reshard_after_forward": lambda c: c.FSDP.RESHARD_AFTER_FORWARD,
    "cpu_offload": lambda c: c.FSDP.CPU_OFFLOAD,
}
PIPELINE_SETTINGS = {
    "stages": lambda c: c.PIPELINE.STAGES,
    "stages_per_rank": lambda c: c.PIPELINE.STAGES_PER_RANK,
    "balance": lambda c: c.PIPELINE.BALANCE,
    "micro_batches": lambda c: c.PIPELINE.MICRO_BATCHES,
    "schedule": lambda c: c.PIPELINE.SCHEDULE,
}
MESH_SETTINGS = {
    "dp": lambda c: c.MESH.DP,
    "dp_replicate": lambda c: c.MESH.DP_REPLICATE,
    "tp": lambda c: c.MESH.TP,
    "pp": lambda c: c.MESH.PP,
    "batch_size": lambda c: c.TRAIN.BATCH_SIZE,
    "accum_steps": lambda c: c.TRAIN.ACCUM_STEPS,
}
LAUNCH_SETTINGS = {
    "num_procs": lambda c: c.NUM_PROCS,
    "cpu_threads": lambda c: c.CPU_THREADS,
    "device": lambda c: c.DEVICE,
    "engine": engine_name,
    "cpu_collectives": lambda c: engine_name(c) in ("fsdp", "tensor") and c.FSDP.CPU_OFFLOAD,
    "depth": lambda c: c.VIT.DEPTH,
    "train_batch_size": lambda c: c.TRAIN.BATCH_SIZE,
    "test_batch_size": lambda c: c.TEST.BATCH_SIZE,
    "accum_steps": lambda c: c.TRAIN.ACCUM_STEPS,
    "pipeline_stages": lambda c: c.PIPELINE.STAGES,
    "pipeline_stages_per_rank": lambda c: c.PIPELINE.STAGES_PER_RANK,
    "pipeline_micro_batches": lambda c: c.PIPELINE.MICRO_BATCHES,
    "pipeline_schedule": lambda c: c.PIPELINE.SCHEDULE,
    "mesh_dp": lambda c: c.MESH.DP,
    "mesh_dp_replicate": lambda c: c.MESH.DP_REPLICATE,
    "mesh_tp": lambda c: c.MESH.TP,
    "mesh_pp": lambda c: c.MESH.PP,
}
