"""What the processes of a run need from the machine, checked before any process starts.

- ``check_cfg``: the parallel settings that cannot work on this machine or with this many
  processes. (The engine x feature rule, ``pycls.engines.support``, is checked when the config
  loads; what is checked here is known only at launch.)
- ``needs_cpu_collectives``: whether the process group needs gloo beside NCCL.
"""

from pycls import distributed as dist
from pycls.errors import ConfigError, require


def check_cfg(cfg, world_size=None):
    """Raises ConfigError naming the key of a parallel setting that cannot work on this machine
    with ``world_size`` processes (None: not known yet)."""
    if cfg.TRAIN.PARALLEL == "fsdp" and cfg.FSDP.BACKEND == "fairscale":
        _check_fairscale(cfg)
    if cfg.TRAIN.PARALLEL == "pipeline":
        _check_pipeline(cfg, world_size)
    elif world_size is not None:
        _check_batches(cfg, world_size)


def _check_batches(cfg, world_size):
    """Each process takes an equal part of every batch (and of a training batch, ACCUM_STEPS
    micro-batches): found here, not by every process once it has started."""
    procs = f"the {world_size} processes (NUM_PROCS, which upstream's NUM_GPUS sets, or torchrun's)"
    for split in ("TRAIN", "TEST"):
        batch = cfg[split].BATCH_SIZE
        require(
            batch % world_size == 0, f"{split}.BATCH_SIZE", f"{batch} is not divisible by {procs}"
        )
    per_process, accum = cfg.TRAIN.BATCH_SIZE // world_size, cfg.TRAIN.ACCUM_STEPS
    require(
        per_process % accum == 0,
        "TRAIN.ACCUM_STEPS",
        f"the {per_process} training images per process do not split into {accum} micro-batches "
        f"(TRAIN.BATCH_SIZE {cfg.TRAIN.BATCH_SIZE} over {world_size} processes)",
    )


def needs_cpu_collectives(cfg):
    """FSDP2 with CPU offload reduces and clips host-side tensors: gloo beside NCCL."""
    return cfg.TRAIN.PARALLEL == "fsdp" and cfg.FSDP.BACKEND == "torch" and cfg.FSDP.CPU_OFFLOAD


def _check_fairscale(cfg):
    require(
        dist.wants_cuda(cfg.DEVICE),
        "FSDP.BACKEND",
        "'fairscale' runs only on CUDA devices (its FSDP needs CUDA streams); use "
        "FSDP.BACKEND torch on the CPU",
    )
    try:
        import fairscale  # noqa: F401  (optional: only FSDP.BACKEND fairscale needs it)
    except ImportError:
        raise ConfigError(
            "FSDP.BACKEND: 'fairscale' needs the fairscale package (pip install fairscale)"
        ) from None


def _check_pipeline(cfg, world_size):
    p, depth = cfg.PIPELINE, cfg.VIT.DEPTH
    chunks = p.STAGES * p.STAGES_PER_RANK
    require(
        chunks <= depth,
        "PIPELINE.STAGES",
        f"{p.STAGES} stages x {p.STAGES_PER_RANK} per rank = {chunks} chunks, more than the "
        f"{depth} blocks of VIT.DEPTH (every chunk needs a block)",
    )
    interleaved = p.SCHEDULE == "interleaved_1f1b"
    require(
        (p.STAGES_PER_RANK > 1) == interleaved,
        "PIPELINE.STAGES_PER_RANK",
        f"{p.STAGES_PER_RANK} does not fit PIPELINE.SCHEDULE {p.SCHEDULE}: interleaved_1f1b "
        "needs several stages per rank, gpipe and 1f1b exactly one",
    )
    if interleaved:
        rounds = max(1, p.MICRO_BATCHES // p.STAGES)
        require(
            p.MICRO_BATCHES % rounds == 0,
            "PIPELINE.MICRO_BATCHES",
            f"interleaved_1f1b needs a multiple of max(1, MICRO_BATCHES // STAGES) = {rounds}",
        )
    if world_size is None:
        return
    require(
        world_size % p.STAGES == 0,
        "PIPELINE.STAGES",
        f"{p.STAGES} does not divide the {world_size} processes (world = replicas x stages)",
    )
    replicas = world_size // p.STAGES
    for split in ("TRAIN", "TEST"):
        batch = cfg[split].BATCH_SIZE
        require(
            batch % replicas == 0,
            f"{split}.BATCH_SIZE",
            f"{batch} is not divisible by the {replicas} data-parallel pipeline replicas",
        )
    per_replica = cfg.TRAIN.BATCH_SIZE // replicas
    require(
        per_replica % p.MICRO_BATCHES == 0,
        "PIPELINE.MICRO_BATCHES",
        f"the {per_replica} training images per replica do not split into {p.MICRO_BATCHES} "
        "micro-batches",
    )
