"""What an engine is asked to do, as plain values: the builders fill ``EngineSettings`` from the
config (TRAIN.PARALLEL, FSDP.*, DDP.*, PIPELINE.*, MESH.*, AMP.REDUCE_DTYPE, TRAIN.COMPILE*,
BN.SYNC), and the engines never see the config itself."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DDPSettings:
    """torch's DistributedDataParallel options (DDP.*)."""

    bucket_cap_mb: float = 25
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass(frozen=True)
class FSDPSettings:
    """Sharding options (FSDP.*): free the gathered weights after the forward pass; keep the
    shards (and their optimizer state) on the host."""

    reshard_after_forward: bool = True
    cpu_offload: bool = False


@dataclass(frozen=True)
class PipelineSettings:
    """The pipeline's cut and schedule (PIPELINE.*)."""

    stages: int = 2
    stages_per_rank: int = 1
    balance: str = "blocks"  # "blocks" or "params"
    micro_batches: int = 4
    schedule: str = "1f1b"  # "gpipe", "1f1b" or "interleaved_1f1b"


@dataclass(frozen=True)
class MeshSettings:
    """The device mesh of TRAIN.PARALLEL tensor (MESH.*): data-parallel replicas (``dp``; 0: the
    processes left over by the other two), tensor-parallel processes per replica (``tp``) and
    pipeline stages (``pp``); FSDP2's replicas under fsdp and tensor (``dp_replicate``, HSDP: 0
    one per machine where the launcher says, ``pycls.distributed.mesh.replicas``). ``batch_size``
    (TRAIN.BATCH_SIZE, images per optimizer step over all processes) and ``accum_steps``
    (TRAIN.ACCUM_STEPS) size the communication estimate every engine logs at start (0: none)."""

    dp: int = 0
    dp_replicate: int = 0
    tp: int = 1
    pp: int = 1
    batch_size: int = 0
    accum_steps: int = 1


@dataclass(frozen=True)
class EngineSettings:
    """Which engine holds the model and how.

    ``engine``: "none", "ddp", "fsdp" (FSDP2), "fairscale", "pipeline" or "tensor" (the keys of
    ``pycls.engines.support.ENGINES``). ``compile`` / ``compile_scope``: torch.compile each
    repeated block ("blocks") or the whole model ("model"), in torch.compile's ``compile_mode``,
    with inductor's coordinate-descent tuning when ``compile_coordinate_descent``
    (``pycls.engines.base.compile_kwargs``). ``reduce_in_compute_dtype``: average
    gradients in the AMP dtype instead of fp32. ``sync_batch_norm``: SyncBatchNorm under DDP.
    ``float8``: "none", or torchao's "tensorwise" / "rowwise" float8 linear layers where both
    sides are at least ``float8_min_dim``, and among those ``float8_layers`` ("all", "mlp" or
    "auto": the roofline's choice at ``float8_micro_batch`` images per process and micro-batch)
    (``pycls.engines.float8``).
    """

    engine: str = "none"
    compile: bool = False
    compile_scope: str = "blocks"
    compile_mode: str = "default"
    compile_coordinate_descent: bool = False
    reduce_in_compute_dtype: bool = False
    sync_batch_norm: bool = False
    float8: str = "none"
    float8_min_dim: int = 2048
    float8_layers: str = "all"
    float8_micro_batch: int = 0
    ddp: DDPSettings = field(default_factory=DDPSettings)
    fsdp: FSDPSettings = field(default_factory=FSDPSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    mesh: MeshSettings = field(default_factory=MeshSettings)
