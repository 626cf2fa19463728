"""TRAIN.PARALLEL fsdp with FSDP.BACKEND fairscale: FairScale FullyShardedDataParallel, one
instance per block and one on the root (CUDA only).

FairScale flattens the parameters of an instance into one tensor, which would merge the
weight-decay and no-decay parameters. So each instance wraps a FlattenParamsWrapper with two flat
parameters (decay, no-decay), sharded as they are (``flatten_parameters=False`` on the FSDP side);
each flat parameter is tagged, and the root reports the no-decay ones through
``no_weight_decay_names`` for the optimizer's groups. Under O1/O2 each norm (LayerNorm or RMSNorm:
the blocks', the QK-norms, a feed-forward's hidden norm, the final ones) gets its own fp32 instance
(FairScale casts everything else to AMP.DTYPE for compute, LayerScale's gamma and a mixed RoPE's
frequencies as FSDP2 does).

Checkpoints: one file that rank 0 writes with the full (gathered) model state and the optimizer
state of every shard (FairScale gathers optimizer state for one parameter group only), which
resumes on the same number of processes; elsewhere (other engines, other process counts) only its
weights load (TRAIN.WEIGHTS), and resuming stops with an error that says so.
"""

import contextlib

import torch
from torch import nn

from pycls import distributed as dist
from pycls.checkpoint import single_file
from pycls.engines.base import (
    Engine,
    WrapperNoSync,
    broadcast_from_rank0,
    fsdp_units,
    gather_to_rank0,
    require_process_group,
)
from pycls.engines.loss_scaling import AgreeingLossScaler
from pycls.engines.mesh_traffic import fsdp_traffic
from pycls.engines.support import ENGINES
from pycls.models.groups import named_saved_buffers, no_weight_decay_names

# The norms that keep fp32 weights of their own under O1/O2
FP32_NORMS = (nn.LayerNorm, nn.RMSNorm)


def wrap_fairscale(model, settings, device, precision):
    """The FairScale-sharded model with decay and no-decay parameters in separate flat ones."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP  # optional engine

    broadcast_from_rank0(model)
    no_decay = {id(p) for n, p in model.named_parameters() if n in no_weight_decay_names(model)}
    mixed = precision is not None and precision.enabled
    common = dict(
        reshard_after_forward=settings.fsdp.reshard_after_forward,
        move_params_to_cpu=settings.fsdp.cpu_offload,
        compute_device=device,
    )
    amp = dict(
        mixed_precision=mixed,
        compute_dtype=precision.dtype if mixed else None,
        fp32_reduce_scatter=mixed and not settings.reduce_in_compute_dtype,
    )
    if mixed and precision.level in ("O1", "O2"):  # norms: fp32 weights, their own flat param
        _wrap_children(
            model, FP32_NORMS, lambda m: _tag(FSDP(m, mixed_precision=False, **common), True)
        )
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _grouped(block, no_decay, FSDP, {**common, **amp})
    root = _grouped(model, no_decay, FSDP, {**common, **amp})
    names = {n for n, p in root.named_parameters() if getattr(p, "_pycls_no_decay", False)}
    root.no_weight_decay_names = lambda: set(names)
    return root


def load_full_state(root, model_state):
    """Copies a full (gathered) model state into the shards of every instance under ``root``.

    FairScale's own ``load_state_dict`` unflattens only the wrappers it made itself: ours (two
    flat parameters per instance, ``flatten_parameters=False``) would be asked for their flat
    parameters. So every instance's full parameters are gathered (written back to the shards on
    exit), every wrapper unflattened into views of them, and each tensor copied in by its name
    without the wrapper prefixes; the names must match exactly."""
    from fairscale.nn.misc import FlattenParamsWrapper  # optional engine

    with root.summon_full_params(recurse=True, volatile=False), contextlib.ExitStack() as stack:
        for module in root.modules():
            if isinstance(module, FlattenParamsWrapper) and module.is_flattened:
                stack.enter_context(module.unflatten_params())
        own = {_clean(n): t for n, t in root.named_parameters()}
        own.update({_clean(n): t for n, t in named_saved_buffers(root)})
        missing, unexpected = (
            sorted(set(own) - set(model_state)),
            sorted(set(model_state) - set(own)),
        )
        if missing or unexpected:
            raise KeyError(f"missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
        with torch.no_grad():
            for name, tensor in own.items():
                value = model_state[name]
                if value.shape != tensor.shape:
                    raise RuntimeError(
                        f"{name}: shape {tuple(value.shape)}, model {tuple(tensor.shape)}"
                    )
                tensor.copy_(value)


def _clean(name):
    """A parameter's name without FairScale's wrapper levels (as the full state dict names it)."""
    return ".".join(p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_fpw_module"))


def _wrap_children(module, kind, wrap):
    for name, child in module.named_children():
        if isinstance(child, kind):
            setattr(module, name, wrap(child))
        else:
            _wrap_children(child, kind, wrap)


def _grouped(module, no_decay_ids, fsdp_cls, kwargs):
    """FSDP over a FlattenParamsWrapper holding the decay and the no-decay parameters apart."""
    from fairscale.nn.misc import FlattenParamsWrapper  # optional engine

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


def _units(model, precision):
    """The instances ``wrap_fairscale`` makes, as FSDP2's units (``base.fsdp_units``) for the
    traffic estimate: approximate, FairScale pads each flat parameter, not each tensor."""
    mixed = precision is not None and precision.enabled
    norms = FP32_NORMS if mixed and precision.level in ("O1", "O2") else ()
    return fsdp_units(model, precision.dtype.itemsize if mixed else 4, norms)


class FairScaleEngine(WrapperNoSync, Engine):
    name = "fairscale"
    holds_master_weights = True
    empty_batches_need_a_pass = True

    def __init__(self, model, settings, device, precision):
        require_process_group("fsdp")
        units = _units(model, precision)  # before the wrappers flatten the parameters
        root = wrap_fairscale(model, settings, device, precision)
        super().__init__(root, settings, device, precision)
        reduce_bytes, f = self.reduce_dtype.itemsize, settings.fsdp
        world, accum = dist.get_world_size(), settings.mesh.accum_steps
        args = (units, 1, world, accum, reduce_bytes, f.reshard_after_forward)
        self._report_traffic(lambda: fsdp_traffic(*args))

    def make_scaler(self):
        return AgreeingLossScaler.for_precision(self.precision, self.device)

    def clip_grad_norm_(self, optimizer, max_norm):
        return self.model.clip_grad_norm_(max_norm)  # over the shards of all processes

    def full_state_dict(self):
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def save(
        self, out_dir, epoch, it=0, *, optimizer, scaler=None, cfg_yaml="", extra=None, writer=None
    ):
        """Rank 0 writes the full model state and every rank's optimizer shard into one file."""
        model_state = self.full_state_dict()  # gathers the full parameters (a collective)
        extra = {**(extra or {}), "world_size": dist.get_world_size()}
        optim_shards = gather_to_rank0(optimizer.state_dict())
        if extra.get("ema_state") is not None:  # the EMA of flat parameter shards, per rank too
            extra["ema_state"] = {"shards": gather_to_rank0(extra["ema_state"])}
        rng_states = gather_to_rank0(single_file.capture_rng_state())
        path = None
        if dist.is_main_proc():
            state = {
                "epoch": epoch,
                "iter": it,
                "model_state": model_state,
                "optimizer_state": {"shards": optim_shards},
                "scaler_state": scaler.state_dict() if scaler is not None else {},
                "cfg": cfg_yaml,
                **single_file.rng_fields(rng_states),
                **extra,
            }
            path = single_file.get_checkpoint_path(out_dir, epoch, it)
            path = single_file.save_file(state, path, writer)
        dist.barrier()
        return path

    def _load_file(self, path, state, optimizer):
        try:
            load_full_state(self.model, state["model_state"])
        except (RuntimeError, KeyError) as e:
            raise single_file.CheckpointError(
                f"checkpoint {path} does not fit this model: {e}"
            ) from e
        if optimizer is None:
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        ema_shards = (state.get("ema_state") or {}).get("shards")
        if ema_shards is not None and len(ema_shards) == world:
            state["ema_state"] = ema_shards[rank]
        elif ema_shards is not None:
            state.pop("ema_state")  # the EMA restarts from the weights
        shards = (state.get("optimizer_state") or {}).get("shards")
        if shards is not None and len(shards) == world:
            optimizer.load_state_dict(shards[rank])
            return
        if shards is None:
            where = "per parameter, as the other engines write it"
        else:
            where = f"flat shards of {len(shards)} processes"
        raise single_file.CheckpointError(
            f"checkpoint {path}: its optimizer state ({where}) does not fit "
            f"{ENGINES['fairscale']} on {world} processes, which needs the flat shards of "
            f"{world}: resume it as it was written, or start from its weights with TRAIN.WEIGHTS "
            "in a new OUT_DIR"
        )
