"""parallelize(model, cfg, device, precision): TRAIN.PARALLEL applied by one function per engine.

- ``none``: the model, cast for the AMP level.
- ``ddp``: DistributedDataParallel; gradients all-reduced in buckets during the backward pass.
- ``fsdp``: parameters, gradients and optimizer state sharded over the processes, with
  FSDP.BACKEND ``torch`` (FSDP2, ``fully_shard`` per block and on the root) or ``fairscale``
  (FairScale FullyShardedDataParallel, CUDA only).
- ``pipeline``: the ViT cut into stages over PIPELINE.STAGES processes (pycls.core.pipeline),
  data-parallel over the rest.

The trainer calls the returned model without knowing which engine wrapped it. What it does need
to know is answered here: whether the optimizer keeps master weights (not under FSDP, whose fp32
shards are the master weights), how to clip gradients, how to skip a gradient sync
(``maybe_no_sync``), and which loss scaler agrees across processes.

Every engine starts from the weights of rank 0: ranks seed their RNG differently (dropout,
augmentation), so they initialise different models, and only DDP broadcasts by itself.
"""

import contextlib

import torch
from torch import nn

from pycls.core import distributed as dist
from pycls.core.config import ConfigError
from pycls.core.precision import DynamicLossScaler

ENGINES = ("none", "ddp", "fsdp", "pipeline")


# ------------------------------------------------------------------------------------------------ #
# Settings that cannot work stop before any work
# ------------------------------------------------------------------------------------------------ #


def _require(ok, key, msg):
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def check_cfg(cfg, world_size=None):
    """Raises ConfigError naming the key of a parallel setting that cannot work.

    Called by the launcher with the config alone, then again once the number of processes is
    known (``world_size``).
    """
    mode = cfg.TRAIN.PARALLEL
    _require(mode in ENGINES, "TRAIN.PARALLEL", f"{mode!r} is not one of {list(ENGINES)}")
    _require(cfg.DDP.BUCKET_CAP_MB > 0, "DDP.BUCKET_CAP_MB", "must be > 0")
    if mode == "fsdp":
        _check_fsdp(cfg)
    if mode == "pipeline":
        _check_pipeline(cfg, world_size)
    if mode in ("fsdp", "pipeline") and "CURRICULUM" in cfg:
        _require(
            not cfg.CURRICULUM.ENABLED,
            "CURRICULUM.ENABLED",
            f"the image-size curriculum resamples the position embedding in place, which "
            f"TRAIN.PARALLEL {mode} splits over processes; use ddp or none",
        )


def _check_fsdp(cfg):
    _require(
        not cfg.OPTIM.CONTIGUOUS_PARAMS,
        "OPTIM.CONTIGUOUS_PARAMS",
        "cannot be used with TRAIN.PARALLEL fsdp: FSDP owns the parameter storage (sharded, "
        "flattened) and the optimizer's flat buffers would replace it; set it False",
    )
    if cfg.FSDP.BACKEND == "fairscale":
        _require(
            dist.wants_cuda(cfg.DEVICE),
            "FSDP.BACKEND",
            "'fairscale' runs only on CUDA devices (its FSDP needs CUDA streams); use "
            "FSDP.BACKEND torch on the CPU",
        )
        try:
            import fairscale  # noqa: F401
        except ImportError:
            raise ConfigError(
                "FSDP.BACKEND: 'fairscale' needs the fairscale package (pip install fairscale)"
            ) from None


def _check_pipeline(cfg, world_size):
    p, depth = cfg.PIPELINE, cfg.VIT.DEPTH
    _require(
        not cfg.DATA_LOADER.SKIP_CORRUPT,
        "DATA_LOADER.SKIP_CORRUPT",
        "cannot be used with TRAIN.PARALLEL pipeline: the processes of a pipeline gather their "
        "shards, which must keep equal sizes",
    )
    for key in ("STAGES", "STAGES_PER_RANK", "MICRO_BATCHES"):
        _require(p[key] >= 1, f"PIPELINE.{key}", f"must be >= 1, got {p[key]}")
    chunks = p.STAGES * p.STAGES_PER_RANK
    _require(
        chunks <= depth,
        "PIPELINE.STAGES",
        f"{p.STAGES} stages x {p.STAGES_PER_RANK} per rank = {chunks} chunks, more than the "
        f"{depth} blocks of VIT.DEPTH (every chunk needs a block)",
    )
    interleaved = p.SCHEDULE == "interleaved_1f1b"
    _require(
        (p.STAGES_PER_RANK > 1) == interleaved,
        "PIPELINE.STAGES_PER_RANK",
        f"{p.STAGES_PER_RANK} does not fit PIPELINE.SCHEDULE {p.SCHEDULE}: interleaved_1f1b "
        "needs several stages per rank, gpipe and 1f1b exactly one",
    )
    if interleaved:
        rounds = max(1, p.MICRO_BATCHES // p.STAGES)
        _require(
            p.MICRO_BATCHES % rounds == 0,
            "PIPELINE.MICRO_BATCHES",
            f"interleaved_1f1b needs a multiple of max(1, MICRO_BATCHES // STAGES) = {rounds}",
        )
    if world_size is None:
        return
    _require(
        world_size % p.STAGES == 0,
        "PIPELINE.STAGES",
        f"{p.STAGES} does not divide the {world_size} processes (world = replicas x stages)",
    )
    replicas = world_size // p.STAGES
    for split in ("TRAIN", "TEST"):
        batch = cfg[split].BATCH_SIZE
        _require(
            batch % replicas == 0,
            f"{split}.BATCH_SIZE",
            f"{batch} is not divisible by the {replicas} data-parallel pipeline replicas",
        )
    per_replica = cfg.TRAIN.BATCH_SIZE // replicas
    _require(
        per_replica % p.MICRO_BATCHES == 0,
        "PIPELINE.MICRO_BATCHES",
        f"the {per_replica} training images per replica do not split into {p.MICRO_BATCHES} "
        "micro-batches",
    )


def needs_cpu_collectives(cfg):
    """FSDP2 with CPU offload reduces and clips host-side tensors: gloo beside NCCL."""
    return cfg.TRAIN.PARALLEL == "fsdp" and cfg.FSDP.BACKEND == "torch" and cfg.FSDP.CPU_OFFLOAD


# ------------------------------------------------------------------------------------------------ #
# What the trainer asks
# ------------------------------------------------------------------------------------------------ #


def holds_master_weights(cfg):
    """FSDP keeps fp32 sharded parameters and computes in half: they are the master weights."""
    return cfg.TRAIN.PARALLEL == "fsdp"


def optimizer_master_weights(cfg, precision):
    """Whether the optimizer keeps its own fp32 copies (AMP O2, unless FSDP already does)."""
    return precision.master_weights and not holds_master_weights(cfg)


def loss_scaler(cfg, precision, device):
    """The AMP level's loss scaler; when processes hold different gradients (FSDP shards,
    pipeline stages), overflow checks are agreed over all processes so all skip the same steps."""
    scaler = precision.make_scaler(device)
    if cfg.TRAIN.PARALLEL in ("fsdp", "pipeline") and isinstance(scaler, DynamicLossScaler):
        # CPU-offloaded shards have their gradients (and overflow checks) on the host
        return AgreeingLossScaler(torch.device("cpu") if needs_cpu_collectives(cfg) else device)
    return scaler


class AgreeingLossScaler(DynamicLossScaler):
    """Dynamic loss scaling whose inf/NaN check is the maximum over all processes.

    Each process sees only its own gradients (a shard, a stage); without agreement one process
    would skip a step that another takes.
    """

    def unscale_(self, optimizer):
        if self._unscaled:
            return
        super().unscale_(optimizer)
        dist.all_reduce_max(self._found_inf)


def clip_grad_norm_(model, optimizer, max_norm):
    """Clips the global gradient norm, whatever holds the gradients; returns the norm.

    Pipelined and FairScale models hold a part of the gradients and clip over all processes
    themselves; FSDP2's DTensor gradients reduce their norm inside torch's clip_grad_norm_.
    """
    own = getattr(model, "clip_grad_norm_", None)
    if own is not None:
        return own(max_norm)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


@contextlib.contextmanager
def maybe_no_sync(model, sync):
    """Context for one backward pass: with ``sync`` False, gradients stay local (accumulation).

    DDP and FairScale: ``no_sync()``. FSDP2: gradient reduction switched off for the pass (FSDP2
    then keeps unsharded gradients until a synchronising backward). Other models: nothing to skip.
    """
    module = getattr(model, "_orig_mod", model)  # under torch.compile
    if sync:
        yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    elif hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    else:
        yield


# ------------------------------------------------------------------------------------------------ #
# Engines
# ------------------------------------------------------------------------------------------------ #


@torch.no_grad()
def broadcast_from_rank0(model):
    """Copies rank 0's parameters and buffers to every process."""
    if dist.get_world_size() == 1:
        return model
    for tensor in [*model.parameters(), *model.buffers()]:
        torch.distributed.broadcast(tensor.data, src=0)
    return model


def apply_ddp(model, cfg, device, precision):
    """DistributedDataParallel with the DDP.* bucket settings (it broadcasts rank 0's weights)."""
    model = precision.prepare_model(model) if precision else model
    d = cfg.DDP
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=d.BUCKET_CAP_MB,
        gradient_as_bucket_view=d.GRADIENT_AS_BUCKET_VIEW,
        static_graph=d.STATIC_GRAPH,
        find_unused_parameters=d.FIND_UNUSED_PARAMETERS,
    )


def fsdp_mixed_precision(precision):
    """FSDP2's policy for the AMP level: O1/O2 compute in half and reduce in fp32, O3 reduces in
    half too, O0 has none. The sharded parameters stay fp32 either way."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision is None or not precision.enabled:
        return MixedPrecisionPolicy()
    reduce = precision.dtype if precision.level == "O3" else torch.float32
    return MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=reduce)


def apply_fsdp_torch(model, cfg, device, precision):
    """FSDP2: ``fully_shard`` each transformer block, then the root (embedding, norm, head).

    Parameters keep their names and become DTensor shards, which the foreach optimizer updates
    directly. Under AMP the model is not cast: the fp32 shards are the master weights and the
    policy casts gathered parameters to half for compute.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    broadcast_from_rank0(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=cfg.FSDP.RESHARD_AFTER_FORWARD,
        mp_policy=fsdp_mixed_precision(precision),
        offload_policy=CPUOffloadPolicy() if cfg.FSDP.CPU_OFFLOAD else OffloadPolicy(),
    )
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_fsdp_fairscale(model, cfg, device, precision):
    """FairScale FullyShardedDataParallel, one instance per block and one on the root.

    FairScale flattens the parameters of an instance into one tensor, which would merge the
    weight-decay and no-decay parameters. So each instance wraps a FlattenParamsWrapper with two
    flat parameters (decay, no-decay), sharded as they are (``flatten_parameters=False`` on the
    FSDP side); each flat parameter is tagged, and the root reports the no-decay ones through
    ``no_weight_decay_names`` for the optimizer's groups. Under O1/O2 each LayerNorm gets its own
    fp32 instance (FairScale casts everything else to AMP.DTYPE for compute).
    """
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    from pycls.core.optimizer import no_weight_decay_names

    broadcast_from_rank0(model)
    no_decay = {id(p) for n, p in model.named_parameters() if n in no_weight_decay_names(model)}
    mixed = precision is not None and precision.enabled
    common = dict(
        reshard_after_forward=cfg.FSDP.RESHARD_AFTER_FORWARD,
        move_params_to_cpu=cfg.FSDP.CPU_OFFLOAD,
        compute_device=device,
    )
    amp = dict(
        mixed_precision=mixed,
        compute_dtype=precision.dtype if mixed else None,
        fp32_reduce_scatter=mixed and precision.level in ("O1", "O2"),
    )
    if mixed and precision.level in ("O1", "O2"):  # norms: fp32 weights, their own flat param
        _wrap_children(
            model, nn.LayerNorm, lambda m: _tag(FSDP(m, mixed_precision=False, **common), True)
        )
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _fairscale_grouped(block, no_decay, FSDP, {**common, **amp})
    root = _fairscale_grouped(model, no_decay, FSDP, {**common, **amp})
    names = {n for n, p in root.named_parameters() if getattr(p, "_pycls_no_decay", False)}
    root.no_weight_decay_names = lambda: set(names)
    return root


def _wrap_children(module, kind, wrap):
    for name, child in module.named_children():
        if isinstance(child, kind):
            setattr(module, name, wrap(child))
        else:
            _wrap_children(child, kind, wrap)


def _fairscale_grouped(module, no_decay_ids, fsdp_cls, kwargs):
    """FSDP over a FlattenParamsWrapper holding the decay and the no-decay parameters apart."""
    from fairscale.nn.misc import FlattenParamsWrapper

    own = [p for p in module.parameters() if not hasattr(p, "_is_sharded")]
    groups = [
        [p for p in own if id(p) not in no_decay_ids],
        [p for p in own if id(p) in no_decay_ids],
    ]
    tags = [tag for tag, g in zip((False, True), groups) if g]
    flat = FlattenParamsWrapper(module, param_list=[g for g in groups if g])
    for p, tag in zip(flat.flat_params, tags):
        p._pycls_no_decay = tag
    return fsdp_cls(flat, flatten_parameters=False, **kwargs)


def _tag(module, no_decay):
    """Marks the (flat) parameters of a FairScale instance as decay or no-decay."""
    for p in module.parameters():
        p._pycls_no_decay = no_decay
    return module


def apply_fsdp(model, cfg, device, precision):
    if cfg.FSDP.BACKEND == "fairscale":
        return apply_fsdp_fairscale(model, cfg, device, precision)
    return apply_fsdp_torch(model, cfg, device, precision)


def apply_pipeline(model, cfg, device, precision):
    from pycls.core.pipeline import apply_pipeline as split

    model = precision.prepare_model(model) if precision else model
    return split(broadcast_from_rank0(model), cfg, device, precision)


_ENGINES = {"ddp": apply_ddp, "fsdp": apply_fsdp, "pipeline": apply_pipeline}


def parallelize(model, cfg, device, precision=None):
    """Applies TRAIN.PARALLEL (and the AMP level's cast) to a model already on its device."""
    mode = cfg.TRAIN.PARALLEL
    if mode == "none":
        return precision.prepare_model(model) if precision else model
    if mode not in _ENGINES:
        raise NotImplementedError(f"TRAIN.PARALLEL: {mode!r} is not available in this build")
    if not dist.is_initialized():
        raise RuntimeError(
            f"TRAIN.PARALLEL={mode} needs a process group: launch with torchrun or set NUM_PROCS"
        )
    return _ENGINES[mode](model, cfg, device, precision)
