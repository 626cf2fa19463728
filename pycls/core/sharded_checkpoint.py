"""Checkpoints of parallel engines: sharded (torch.distributed.checkpoint) and FairScale.

Which format a run writes depends on who holds the weights:

- one process, or DDP (every process holds everything): the single-file pycls checkpoint that
  rank 0 writes (pycls.core.checkpoint);
- FSDP2 and the pipeline (each process holds a part): a DCP folder
  ``OUT_DIR/checkpoints/model_epoch_XXXX/``. Every process writes its part of the model and
  optimizer state, keyed by the parameters' names (optimizer state flattened per name), so the
  folder loads into any number of processes and any engine, a single plain process included.
  Beside the DCP files: ``train_state.pyth`` (epoch, scaler, config, best error; rank 0) and
  ``rng_rankN.pyth`` (each process's RNG). All is written into ``<name>.tmp/`` and renamed by rank 0
  after a barrier, so a folder under its final name is always complete;
- FairScale FSDP: a single file written by rank 0 with the full (gathered) model state, and the
  optimizer state of every shard (FairScale gathers optimizer state for one parameter group only),
  which resumes on the same number of processes.

``load_checkpoint`` reads either kind into any engine. ``consolidate`` turns a DCP folder into a
single-file pycls checkpoint (for sharing weights or evaluating without a process group).
"""

import os
import shutil
import warnings

import torch

from pycls.core import checkpoint
from pycls.core import checkpoint_integrity as ckpt_integrity  # issue 11: manifests, safe reads
from pycls.core import distributed as dist
from pycls.core import logging as logs

logger = logs.get_logger(__name__)

TRAIN_STATE = "train_state.pyth"
RNG_STATE = "rng_rank{}.pyth"


# ------------------------------------------------------------------------------------------------ #
# Which engine holds the model
# ------------------------------------------------------------------------------------------------ #


def _plain(model):
    return getattr(model, "_orig_mod", model)


def is_fairscale(model):
    return type(_plain(model)).__module__.startswith("fairscale.")


def holds_part(model):
    """Whether this process holds only part of the model (FSDP2 shards or pipeline stages)."""
    from torch.distributed.fsdp import FSDPModule

    from pycls.core.pipeline import PipelinedViT

    return isinstance(_plain(model), (FSDPModule, PipelinedViT))


def _dcp_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer state flattened per parameter name: pipeline stages and shards each write their
    # own keys, and any other layout can read them back
    return StateDictOptions(flatten_optimizer_state_dict=True, **kwargs)


# ------------------------------------------------------------------------------------------------ #
# Saving
# ------------------------------------------------------------------------------------------------ #


def save_checkpoint(out_dir, epoch, *, model, optimizer, cfg_yaml, scaler=None, extra=None, it=0):
    """Writes the checkpoint after ``epoch`` epochs (and ``it`` iterations of the next one, for a
    mid-epoch stop) in the format the engine needs; every process must call it. Returns the path
    on rank 0, None elsewhere."""
    kwargs = dict(model=model, optimizer=optimizer, cfg_yaml=cfg_yaml, scaler=scaler, extra=extra)
    if holds_part(model):
        return save_sharded(out_dir, epoch, it=it, **kwargs)
    if is_fairscale(model):
        return save_fairscale(out_dir, epoch, it=it, **kwargs)
    path = None
    if dist.is_main_proc():
        path = checkpoint.save_checkpoint(out_dir, epoch, it=it, **kwargs)
    dist.barrier()  # nobody runs ahead (and, say, exits) before the file is complete
    return path


def _train_state(epoch, it, scaler, cfg_yaml, extra):
    state = {
        "epoch": epoch,
        "iter": it,
        "scaler_state": scaler.state_dict() if scaler is not None else {},
        "cfg": cfg_yaml,
        "world_size": dist.get_world_size(),
    }
    state.update(extra or {})
    return state


def save_sharded(out_dir, epoch, *, model, optimizer, cfg_yaml, scaler=None, extra=None, it=0):
    """Every process writes its part into a DCP folder; rank 0 renames it into place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoint.get_checkpoint_path(out_dir, epoch, it=it, sharded=True)
    tmp = f"{final}.tmp"
    if dist.is_main_proc():
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(tmp)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_dcp_options())
    state = {"model": model_state, "optimizer": optim_state}
    extra = dict(extra or {})
    if extra.get("ema_state") is not None:  # shards like the parameters: into the DCP files
        ema = dict(extra["ema_state"])
        state["ema"] = ema.pop("tensors")
        extra["ema_state"] = ema
    with ckpt_integrity.guard(tmp, "write"):
        dcp.save(state, checkpoint_id=tmp)
    rank = dist.get_rank()
    checkpoint.save_file(
        {"rng_state": checkpoint.capture_rng_state()}, os.path.join(tmp, RNG_STATE.format(rank))
    )
    dist.barrier()
    if dist.is_main_proc():
        state = _train_state(epoch, it, scaler, cfg_yaml, extra)
        checkpoint.save_file(state, os.path.join(tmp, TRAIN_STATE))
        ckpt_integrity.seal(tmp)  # every file's size and checksum, verified before loading
        if os.path.isdir(final):  # written before (a re-run of the same epoch)
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final if dist.is_main_proc() else None


def save_fairscale(out_dir, epoch, *, model, optimizer, cfg_yaml, scaler=None, extra=None, it=0):
    """Rank 0 writes the full model state and every rank's optimizer shard into one file."""
    model_state = model.state_dict()  # gathers the full parameters (a collective)
    extra = dict(extra or {})
    optim_shards = _gather_to_rank0(optimizer.state_dict())
    if extra.get("ema_state") is not None:  # the EMA of flat parameter shards, per rank too
        extra["ema_state"] = {"shards": _gather_to_rank0(extra["ema_state"])}
    path = None
    if dist.is_main_proc():
        state = _train_state(epoch, it, scaler, cfg_yaml, extra)
        state.update(
            model_state={k: v.detach().cpu() for k, v in model_state.items()},
            optimizer_state={"shards": optim_shards},
            rng_state=checkpoint.capture_rng_state(),
        )
        path = checkpoint.save_file(state, checkpoint.get_checkpoint_path(out_dir, epoch, it=it))
    dist.barrier()
    return path


def _gather_to_rank0(obj):
    """Every rank's ``obj`` (tensors moved to the CPU first), as a list on rank 0."""
    out = [None] * dist.get_world_size() if dist.is_main_proc() else None
    torch.distributed.gather_object(_to_cpu(obj), out, dst=0)
    return out


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


# ------------------------------------------------------------------------------------------------ #
# Loading
# ------------------------------------------------------------------------------------------------ #


def is_sharded_checkpoint(path):
    return os.path.isdir(path)


def read_state(path):
    """The train state of a checkpoint of either kind (epoch, iter, cfg, scaler, extras); for a
    single file, the whole checkpoint dict."""
    if is_sharded_checkpoint(path):
        if not ckpt_integrity.verify(path):
            logger.warning(f"{path}: no manifest (written by an older pycls); loaded unverified")
        return checkpoint.load_file(os.path.join(path, TRAIN_STATE))
    return checkpoint.load_file(path)


def restore(path, state, *, model, optimizer=None, scaler=None, restore_rng=True):
    """Restores a checkpoint (``state`` from ``read_state``) into a model of any engine; returns
    ``state``, with the EMA tensors of a sharded checkpoint filled in. Every process calls it."""
    if is_sharded_checkpoint(path):
        _restore_sharded(path, state, model, optimizer, restore_rng)
    elif is_fairscale(model):
        _load_fairscale(path, state, model, optimizer)
        if restore_rng and "rng_state" in state:
            checkpoint.restore_rng_state(state["rng_state"])
    elif holds_part(model):
        _load_full_into(path, state, model, optimizer)
        if restore_rng and "rng_state" in state:
            checkpoint.restore_rng_state(state["rng_state"])
    else:
        if optimizer is not None and "shards" in (state.get("optimizer_state") or {}):
            logger.warning(
                f"{path}: FairScale optimizer shards do not fit this engine; the "
                "optimizer starts afresh (weights loaded)"
            )
            optimizer = None
        return checkpoint.restore_checkpoint(
            path, state, model=model, optimizer=optimizer, scaler=scaler, restore_rng=restore_rng
        )
    if scaler is not None and state.get("scaler_state"):
        scaler.load_state_dict(state["scaler_state"])
    return state


def load_checkpoint(path, *, model, optimizer=None, scaler=None, restore_rng=True):
    """``restore`` of the checkpoint at ``path``; returns its train state."""
    state = read_state(path)
    return restore(
        path, state, model=model, optimizer=optimizer, scaler=scaler, restore_rng=restore_rng
    )


def load_model_weights(path, model):
    """Only the weights of a checkpoint of either kind, into a model of any engine."""
    return load_checkpoint(path, model=model, restore_rng=False)


def _ema_template(model):
    """fp32 tensors shaped (and sharded) like the EMA's: parameters, then float buffers."""
    named = list(model.named_parameters())
    named += [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    return {n: t.detach().float().clone() for n, t in named}


def _restore_sharded(path, train_state, model, optimizer, restore_rng):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    model = checkpoint.unwrap_model(model)  # DDP's own names; FSDP2 and pipeline are unwrapped
    options = _dcp_options()
    try:
        if optimizer is None:
            state = {"model": sd.get_model_state_dict(model, options=options)}
        else:
            _materialize_optimizer_state(optimizer)
            model_state, optim_state = sd.get_state_dict(model, optimizer, options=options)
            state = {"model": model_state, "optimizer": optim_state}
        ema = train_state.get("ema_state")
        if ema is not None and "tensors" not in ema:
            state["ema"] = _ema_template(model)
        with warnings.catch_warnings():  # one process reading a multi-process folder: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            with ckpt_integrity.guard(path):  # the metadata is unpickled with an allowlist
                dcp.load(state, storage_reader=ckpt_integrity.reader(path))
        if optimizer is None:
            sd.set_model_state_dict(model, state["model"], options=options)
        else:
            sd.set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
    except checkpoint.CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError) as e:
        raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this model: {e}") from e
    if "ema" in state:
        train_state["ema_state"] = {**train_state["ema_state"], "tensors": state["ema"]}
    rng_file = os.path.join(path, RNG_STATE.format(dist.get_rank()))
    if restore_rng and os.path.isfile(rng_file):
        # A process that did not exist when the checkpoint was written keeps its fresh RNG
        checkpoint.restore_rng_state(checkpoint.load_file(rng_file)["rng_state"])


@torch.no_grad()
def _materialize_optimizer_state(optimizer):
    """Creates every state tensor (a step with zero gradients and a zero rate), so the state dict
    names all the tensors a checkpoint will fill. torch's own helper skips optimizers that hold
    any state, such as master weights, and would leave the moments out."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all("step" in optimizer.state.get(p, {}) for p in params):
        return
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, rates):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def _load_full_into(path, state, model, optimizer):
    """A single-file checkpoint (full tensors) into a plain, DDP, FSDP2 or pipelined model."""
    if not holds_part(model):
        checkpoint.restore_checkpoint(
            path, state, model=model, optimizer=optimizer, restore_rng=False
        )
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _plain(model)
    own = set(model.state_dict().keys())
    full = {k: v for k, v in state["model_state"].items() if k in own}
    options = StateDictOptions(full_state_dict=True)
    try:
        set_model_state_dict(model, full, options=options)
        if optimizer is not None:
            _materialize_optimizer_state(optimizer)
            named = _optimizer_state_by_name(state["optimizer_state"], model)
            set_optimizer_state_dict(model, optimizer, named, options=options)
    except (RuntimeError, KeyError, ValueError) as e:
        raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this model: {e}") from e


def _optimizer_state_by_name(saved, model):
    """A torch.optim state dict (parameters numbered) keyed by parameter names instead.

    The saved numbering follows the saved optimizer's groups, which were built from the whole
    model the same way (decay, then no-decay, each in parameter order); the numbers are mapped
    through the whole model's names and kept for the parameters this process holds.
    """
    from pycls.core.optimizer import no_weight_decay_names

    own = [n for n, _ in model.named_parameters()]
    names = getattr(model, "whole_model_names", own)
    skip = getattr(model, "whole_model_no_decay", None) or no_weight_decay_names(model)
    by_group = {
        "decay": [n for n in names if n not in skip],
        "no_decay": [n for n in names if n in skip],
    }
    state, groups = {}, []
    for group in saved["param_groups"]:
        group_names = by_group.get(group.get("name"), [])
        for i, name in zip(group["params"], group_names):
            if name in own and i in saved["state"]:
                state[name] = saved["state"][i]
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [n for n in group_names if n in own]})
    return {"state": state, "param_groups": [g for g in groups if g["params"]]}


def _load_fairscale(path, state, model, optimizer):
    try:
        model.load_state_dict(state["model_state"])
    except (RuntimeError, KeyError) as e:
        raise checkpoint.CheckpointError(f"checkpoint {path} does not fit this model: {e}") from e
    if optimizer is None:
        return
    ema_shards = (state.get("ema_state") or {}).get("shards")
    if ema_shards is not None and len(ema_shards) == dist.get_world_size():
        state["ema_state"] = ema_shards[dist.get_rank()]
    elif ema_shards is not None:
        state.pop("ema_state")  # the EMA restarts from the weights
    shards = (state.get("optimizer_state") or {}).get("shards")
    if shards and len(shards) == dist.get_world_size():
        optimizer.load_state_dict(shards[dist.get_rank()])
    else:
        logger.warning(
            f"{path}: optimizer state of {len(shards or [])} FairScale shards does not fit "
            f"{dist.get_world_size()} processes; the optimizer starts afresh (weights loaded)"
        )


# ------------------------------------------------------------------------------------------------ #
# Consolidation
# ------------------------------------------------------------------------------------------------ #


def consolidate(path, out_file=None):
    """Writes a DCP checkpoint folder as a single-file pycls checkpoint; returns the file's path.

    The result holds the full model state (and train state) and loads with
    ``checkpoint.load_model_weights`` in one process (TEST.WEIGHTS, TRAIN.WEIGHTS). The optimizer
    state stays in the folder: its numbering depends on how the optimizer was built.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out_file = out_file or f"{path.rstrip(os.sep)}.pyth"
    ckpt_integrity.verify(path)
    reader = ckpt_integrity.reader(path)
    with ckpt_integrity.guard(path):
        metadata = reader.read_metadata()
    model = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # one process reading a multi-process folder: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with ckpt_integrity.guard(path):
            dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    state = checkpoint.load_file(os.path.join(path, TRAIN_STATE))
    state.update(model_state=model, optimizer_state={})
    rng_file = os.path.join(path, RNG_STATE.format(0))
    if os.path.isfile(rng_file):
        state["rng_state"] = checkpoint.load_file(rng_file)["rng_state"]
    return checkpoint.save_file(state, out_file)


# ------------------------------------------------------------------------------------------------ #
# The whole model in one place
# ------------------------------------------------------------------------------------------------ #


def full_model_state(model):
    """The whole model's state dict (full tensors) on rank 0; every process must call it.

    Other ranks get a (possibly partial or empty) dict they should not use.
    """
    from torch.distributed.fsdp import FSDPModule

    from pycls.core.pipeline import PipelinedViT

    plain = _plain(model)
    if isinstance(plain, FSDPModule):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(plain, options=options)
    if isinstance(plain, PipelinedViT):
        parts = _gather_to_rank0(plain.state_dict())
        merged = {}
        for part in parts or []:
            merged.update(part)
        return merged
    if is_fairscale(model):
        return {k: v.detach().cpu() for k, v in plain.state_dict().items()}
    return checkpoint.unwrap_model(model).state_dict()
