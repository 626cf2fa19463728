"""What the processes of a run need from the machine, checked before any process starts.

``check_launch(settings, world_size)``: the parallel settings (a ``LaunchSettings``,
``pycls.distributed.launch_settings``) that cannot work on this machine or with this many
processes. (The engine x feature rule,
``pycls.engines.support``, is checked when the config loads; what is checked here is known only
at launch.)
"""

import torch

from pycls import distributed as dist
from pycls.distributed.mesh_layout import mesh_shape, replica_shape
from pycls.errors import ConfigError, require


def check_launch(s, world_size=None):
    """Raises ConfigError naming the key of a parallel setting that cannot work on this machine
    with ``world_size`` processes (None: not known yet)."""
    if s.engine == "fairscale":
        _check_fairscale(s)
    if s.engine == "pipeline":
        _check_pipeline(s, world_size)
    elif s.engine == "tensor":
        _check_mesh(s, world_size)
    elif world_size is not None:
        _check_batches(s, world_size)
        if s.engine == "fsdp" and s.mesh_dp_replicate > 0:
            replica_shape(world_size, s.mesh_dp_replicate)


def _check_batches(s, world_size):
    """Each process takes an equal part of every batch (and of a training batch, ACCUM_STEPS
    micro-batches): found here, not by every process once it has started."""
    procs = f"the {world_size} processes (NUM_PROCS, which upstream's NUM_GPUS sets, or torchrun's)"
    for split, batch in (("TRAIN", s.train_batch_size), ("TEST", s.test_batch_size)):
        require(
            batch % world_size == 0, f"{split}.BATCH_SIZE", f"{batch} is not divisible by {procs}"
        )
    per_process, accum = s.train_batch_size // world_size, s.accum_steps
    require(
        per_process % accum == 0,
        "TRAIN.ACCUM_STEPS",
        f"the {per_process} training images per process do not split into {accum} micro-batches "
        f"(TRAIN.BATCH_SIZE {s.train_batch_size} over {world_size} processes)",
    )


def _check_fairscale(s):
    require(
        dist.wants_cuda(s.device),
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


def _check_pipeline(s, world_size):
    stages, per_rank, micro = (
        s.pipeline_stages,
        s.pipeline_stages_per_rank,
        s.pipeline_micro_batches,
    )
    chunks = stages * per_rank
    require(
        chunks <= s.depth,
        "PIPELINE.STAGES",
        f"{stages} stages x {per_rank} per rank = {chunks} chunks, more than the "
        f"{s.depth} blocks of VIT.DEPTH (every chunk needs a block)",
    )
    interleaved = s.pipeline_schedule == "interleaved_1f1b"
    require(
        (per_rank > 1) == interleaved,
        "PIPELINE.STAGES_PER_RANK",
        f"{per_rank} does not fit PIPELINE.SCHEDULE {s.pipeline_schedule}: interleaved_1f1b "
        "needs several stages per rank, gpipe and 1f1b exactly one",
    )
    if interleaved:
        rounds = max(1, micro // stages)
        require(
            micro % rounds == 0,
            "PIPELINE.MICRO_BATCHES",
            f"interleaved_1f1b needs a multiple of max(1, MICRO_BATCHES // STAGES) = {rounds}",
        )
    if world_size is None:
        return
    require(
        world_size % stages == 0,
        "PIPELINE.STAGES",
        f"{stages} does not divide the {world_size} processes (world = replicas x stages)",
    )
    replicas = world_size // stages
    for split, batch in (("TRAIN", s.train_batch_size), ("TEST", s.test_batch_size)):
        require(
            batch % replicas == 0,
            f"{split}.BATCH_SIZE",
            f"{batch} is not divisible by the {replicas} data-parallel pipeline replicas",
        )
    per_replica = s.train_batch_size // replicas
    require(
        per_replica % micro == 0,
        "PIPELINE.MICRO_BATCHES",
        f"the {per_replica} training images per replica do not split into {micro} micro-batches",
    )


def _check_mesh(s, world_size):
    """The mesh fits the processes (MESH.DP x TP x PP), and with MESH.PP > 1 the pipeline's cut
    and schedule fit as for TRAIN.PARALLEL pipeline."""
    if world_size is None:
        return
    pp, dp, tp = mesh_shape(world_size, s.mesh_dp, s.mesh_tp, s.mesh_pp)
    if s.mesh_dp_replicate > 0:
        replica_shape(dp, s.mesh_dp_replicate)
    for split, batch in (("TRAIN", s.train_batch_size), ("TEST", s.test_batch_size)):
        require(
            batch % world_size == 0,
            f"{split}.BATCH_SIZE",
            f"{batch} is not divisible by the {world_size} processes (each loads its own share)",
        )
    if pp > 1:
        replica = s.train_batch_size // dp
        require(
            replica % s.pipeline_micro_batches == 0,
            "PIPELINE.MICRO_BATCHES",
            f"the {replica} training images per replica do not split into "
            f"{s.pipeline_micro_batches} micro-batches",
        )


# Float8 matmuls (torch._scaled_mm on tensor cores): NVIDIA compute capability 8.9 (Ada) and newer
FLOAT8_CAPABILITY = (8, 9)


def check_float8(recipe, device):
    """Raises ConfigError naming AMP.FLOAT8 where ``device`` (DEVICE: "cpu", "cuda" or "auto")
    has no float8 matmuls, or torchao is missing; nothing for ``recipe`` "none"."""
    if recipe == "none":
        return
    where = "the CPU (float8 would be emulated, slower than bfloat16)"
    if dist.wants_cuda(device):
        capability = torch.cuda.get_device_capability()
        where = None
        if capability < FLOAT8_CAPABILITY:
            name = torch.cuda.get_device_name()
            where = f"{name} (compute capability {capability[0]}.{capability[1]})"
    require(
        where is None,
        "AMP.FLOAT8",
        f"{recipe} needs float8 matmuls, which NVIDIA GPUs of compute capability 8.9 or newer have "
        f"(Ada, Hopper, Blackwell); this run's device is {where}: set AMP.FLOAT8 none",
    )
    try:
        import torchao.float8  # noqa: F401  (optional: only AMP.FLOAT8 needs torchao)
    except ImportError:
        raise ConfigError(
            "AMP.FLOAT8: needs the torchao package (pip install torchao, or pycls-vit[float8])"
        ) from None
