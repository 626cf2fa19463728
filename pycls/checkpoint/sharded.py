"""Sharded checkpoints (torch.distributed.checkpoint folders) and loading full tensors into split
models: the state layouts the engines (pycls.engines) choose from.

- A DCP folder ``OUT_DIR/checkpoints/model_epoch_XXXX/`` (FSDP2, pipeline): every process writes
  its part of the model and optimizer state, keyed by the parameters' names (optimizer state
  flattened per name), so the folder loads into any number of processes and any engine, a single
  plain process included. Beside the DCP files: ``train_state.pyth`` (epoch, scaler, config, best
  error; rank 0) and ``rng_rankN.pyth`` (each process's RNG). All is written into ``<name>.tmp/``
  and renamed by rank 0 after a barrier, so a folder under its final name is always complete.
- ``load_full_into``: a single-file checkpoint (full tensors, ``single_file``) into a model
  whose processes each hold a part (FSDP2 shards, pipeline stages).

``consolidate`` turns a DCP folder into a single-file pycls checkpoint (for sharing weights or
evaluating without a process group).

Files hold every tensor in the model's own layout. An engine that keeps some in another (tensor
parallelism reorders the rows of the attention's qkv projection for its mesh) passes a ``layout``:
an object whose ``convert_state(state, to_mesh)`` maps a state of sections "model", "optimizer"
(flattened per parameter name) and "ema" between the two.
"""

import contextlib
import logging
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import state_dict as sd
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pycls import distributed as dist
from pycls.checkpoint import async_writes, files, single_file
from pycls.models.groups import named_saved_buffers, no_weight_decay_names

logger = logging.getLogger(__name__)

TRAIN_STATE = "train_state.pyth"
RNG_STATE = "rng_rank{}.pyth"


def _dcp_options(**kwargs):
    # Optimizer state flattened per parameter name: pipeline stages and shards each write their
    # own keys, and any other layout can read them back
    return StateDictOptions(flatten_optimizer_state_dict=True, **kwargs)


# ------------------------------------------------------------------------------------------------ #
# Saving
# ------------------------------------------------------------------------------------------------ #


def _train_state(epoch, it, scaler, cfg_yaml, extra):
    state = {
        "epoch": epoch,
        "iter": it,
        "scaler_state": scaler.state_dict() if scaler is not None else {},
        "cfg": cfg_yaml,
        "world_size": dist.get_world_size(),
        # The folder is sealed with a manifest (files.seal): without one it has been altered
        "manifest": files.MANIFEST,
    }
    state.update(extra or {})
    return state


def save_sharded(
    out_dir,
    epoch,
    *,
    module,
    optimizer,
    cfg_yaml,
    scaler=None,
    extra=None,
    it=0,
    layout=None,
    writer=None,
):
    """Every process writes its part of ``module`` (FSDP2, tensor-parallel or pipelined) and its
    optimizer into a DCP folder (in the model's own layout: ``layout``, see above); rank 0 seals
    and renames it into place. Returns the path on rank 0, None elsewhere.

    With ``writer`` (an ``async_writes.Writer`` holding its own process group, ``writer.group``):
    DCP's ``async_save`` copies the state to host memory now and writes it in the background;
    rank 0's write then seals and renames the folder once every process's part is written (its
    save completes only then). Returns at once."""
    final = single_file.get_checkpoint_path(out_dir, epoch, it=it, sharded=True)
    tmp = f"{final}.tmp"
    if dist.is_main_proc():
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(tmp)
    dist.barrier()
    model_state, optim_state = get_state_dict(module, optimizer, options=_dcp_options())
    state = {"model": model_state, "optimizer": optim_state}
    extra = dict(extra or {})
    if extra.get("ema_state") is not None:  # shards like the parameters: into the DCP files
        ema = dict(extra["ema_state"])
        state["ema"] = ema.pop("tensors")
        extra["ema_state"] = ema
    if layout is not None:
        state = layout.convert_state(state, to_mesh=False)
    train_state = _train_state(epoch, it, scaler, cfg_yaml, extra) if dist.is_main_proc() else None
    rng = {"rng_state": single_file.capture_rng_state()}
    rng_file = os.path.join(tmp, RNG_STATE.format(dist.get_rank()))
    if writer is None:
        with _removed_on_failure(tmp), files.guard(tmp, "write"):
            single_file.save_file(rng, rng_file)
            async_writes.fault_point("staged", tmp)
            _write_dcp(state, tmp)
            dist.barrier()
            _seal_and_rename(tmp, final, train_state)
        dist.barrier()
        return final if dist.is_main_proc() else None
    with _removed_on_failure(tmp):
        saved = _write_dcp(state, tmp, writer)
    staged = writer.stage((rng, train_state), "train state")
    writer.submit(final, lambda: _finish_async(saved, tmp, final, staged, writer.group))
    return final if dist.is_main_proc() else None


class _MarkedWriter(dcp.FileSystemWriter):
    """DCP's file writer, marking ``mid_write`` once this process's data files are written
    (the folder's ``.metadata`` is not yet). Given an ``async_writes.Writer``, it stages the state
    into the host copy of the previous save where the state's layout is the same (DCP's own
    cache pins memory, which a machine without CUDA has none of)."""

    def __init__(self, path, writer=None):
        super().__init__(path)
        self.writer = writer

    def stage(self, state_dict):
        if self.writer is None:
            return super().stage(state_dict)
        staged, cached = None, self.writer.staged.get("dcp")
        if cached is not None and self.writer.in_flight is None:  # no write reads it any more
            with contextlib.suppress(Exception):  # another layout (a new image size, an EMA)
                staged = _copy_state_dict(state_dict, cached)
        if staged is None:
            staged = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            staged = _copy_state_dict(state_dict, staged)
        self.writer.staged["dcp"] = staged
        return staged

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        async_writes.fault_point("mid_write", str(self.path))
        return written


def _write_dcp(state, tmp, writer=None):
    """This process's part of ``state`` into the DCP folder ``tmp``; with ``writer``, started in
    the background (DCP's async_save, coordinated over ``writer.group``), its future
    returned."""
    with files.guard(tmp, "write"), warnings.catch_warnings():
        # torch 2.10's DCP writer calls the deprecated tensor.storage() (later torch does
        # not): a warning about torch's own code, on every save
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        if writer is None:
            return dcp.save(state, checkpoint_id=tmp, storage_writer=_MarkedWriter(tmp))
        into = _MarkedWriter(tmp, writer)
        saved = dcp.async_save(
            state, checkpoint_id=tmp, storage_writer=into, process_group=writer.group
        )
    # torch >= 2.9 may answer with its staging and upload futures apart
    return getattr(saved, "upload_completion", saved)


def _finish_async(saved, tmp, final, staged, group):
    """The background part of an asynchronous sharded save: this process's DCP write finished
    and its RNG file written; then, once every process says its part is in (over ``group``,
    whose collectives DCP has finished using by then), rank 0 seals and renames the folder."""
    rng, train_state = staged
    error = _failure(lambda: async_writes.fault_point("staged", tmp), tmp)
    error = _failure(saved.result, tmp) or error  # DCP's threads done with the folder first
    if error is None:
        rng_file = os.path.join(tmp, RNG_STATE.format(dist.get_rank()))
        error = _failure(lambda: single_file.save_file(rng, rng_file), tmp)
    with _removed_on_failure(tmp):
        failed = torch.tensor([float(error is not None)])
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=group)
        if failed.item():
            raise error or files.CheckpointWriteError(
                f"cannot write {final}: another process failed to write its part"
            )
    _seal_and_rename(tmp, final, train_state)


def _failure(step, tmp):
    """The CheckpointError that ``step()`` ends with (whatever it raised, in words), or None."""
    try:
        with files.guard(tmp, "write"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            step()
    except single_file.CheckpointError as e:
        return e
    return None


def _seal_and_rename(tmp, final, train_state):
    """Rank 0: the train state written beside the parts, the folder sealed with its manifest and
    renamed into place."""
    if not dist.is_main_proc():
        return
    with _removed_on_failure(tmp), files.guard(tmp, "write"):
        single_file.save_file(train_state, os.path.join(tmp, TRAIN_STATE))
        async_writes.fault_point("before_manifest", tmp)
        files.seal(tmp)  # every file's size and checksum, verified before loading
        async_writes.fault_point("before_rename", tmp)
        if os.path.isdir(final):  # written before (a re-run of the same epoch)
            shutil.rmtree(final)
        os.replace(tmp, final)


@contextlib.contextmanager
def _removed_on_failure(tmp):
    """A failed write's partial folder would hold the disk full until the next start: rank 0
    removes it (the error has already been described, the free space measured)."""
    try:
        yield
    except single_file.CheckpointError:
        if dist.is_main_proc():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def to_cpu(obj):
    """``obj`` with every tensor detached and moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# ------------------------------------------------------------------------------------------------ #
# Loading
# ------------------------------------------------------------------------------------------------ #


def is_sharded_checkpoint(path):
    return os.path.isdir(path)


def read_state(path, allow_unverified=False):
    """The train state of a checkpoint of either kind (epoch, iter, cfg, scaler, extras); for a
    single file, the whole checkpoint dict.

    A folder is verified against its manifest. Without one: a folder pycls sealed (its
    checksummed train state says so) has been altered and is refused; any other (an older
    pycls's, or another program's DCP folder) loads only with ``allow_unverified``
    (ALLOW_UNVERIFIED_CHECKPOINTS), with a warning.
    """
    if not is_sharded_checkpoint(path):
        return single_file.load_file(path)
    if files.verify(path):
        return single_file.load_file(os.path.join(path, TRAIN_STATE))
    train_file = os.path.join(path, TRAIN_STATE)
    state = single_file.load_file(train_file) if os.path.exists(train_file) else None
    if state is not None and state.get("manifest"):
        raise single_file.CheckpointError(
            f"checkpoint {path}: its {files.MANIFEST} is missing, but pycls sealed this folder "
            "with one (its train state says so): the folder was altered and none of its files "
            "can be verified; it is not loaded"
        )
    origin = "written by an older pycls" if state is not None else "not written by pycls"
    if not allow_unverified:
        raise single_file.CheckpointError(
            f"checkpoint {path} has no {files.MANIFEST} ({origin}): none of its files can be "
            "verified. Set ALLOW_UNVERIFIED_CHECKPOINTS True to load it anyway"
        )
    logger.warning(f"{path}: no {files.MANIFEST} ({origin}); loaded UNVERIFIED")
    return state if state is not None else {}


def load_model_weights(path, module, allow_unverified=False):
    """Only the weights of a checkpoint of either layout into a plain module (TEST.WEIGHTS,
    TRAIN.WEIGHTS), read by this process alone: no collective, since under FSDP2 and the pipeline
    only rank 0 holds the plain model (the engine then hands each process its part)."""
    if not is_sharded_checkpoint(path):
        return single_file.load_model_weights(path, module)
    state = read_state(path, allow_unverified)
    state["model_state"] = read_model_state(path)
    single_file.restore_checkpoint(path, state, model=module)
    return state


def _ema_template(model):
    """fp32 tensors shaped (and sharded) like the EMA's: parameters, then the float buffers a
    checkpoint holds (as ``pycls.core.ema`` averages them)."""
    named = list(model.named_parameters())
    named += [(n, b) for n, b in named_saved_buffers(model) if b.is_floating_point()]
    return {n: t.detach().float().clone() for n, t in named}


def restore_sharded(path, train_state, model, optimizer=None, restore_rng=True, layout=None):
    """A DCP folder into ``model`` (a plain, FSDP2, tensor-parallel or pipelined module: not a DDP
    wrapper) and its optimizer, in any number of processes and on any mesh; fills the EMA tensors
    into ``train_state``. ``layout``: the engine's own tensor layout (see above)."""
    options = _dcp_options()
    try:
        if optimizer is None:
            state = {"model": sd.get_model_state_dict(model, options=options)}
        else:
            _materialize_optimizer_state(optimizer)
            model_state, optim_state = sd.get_state_dict(model, optimizer, options=options)
            state = {"model": model_state, "optimizer": optim_state}
        masters = _masters_from_weights(path, state)
        ema = train_state.get("ema_state")
        if ema is not None and "tensors" not in ema:
            state["ema"] = _ema_template(model)
        with warnings.catch_warnings():  # one process reading a multi-process folder: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            with files.guard(path):  # the metadata is unpickled with an allowlist
                dcp.load(state, storage_reader=files.reader(path))
                if masters:
                    dcp.load({"model": masters}, storage_reader=files.reader(path))
            for name, master in masters.items():
                state["optimizer"][f"state.{name}.master"] = master
        if layout is not None:
            state = layout.convert_state(state, to_mesh=True)
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
    except single_file.CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError) as e:
        raise single_file.CheckpointError(f"checkpoint {path} does not fit this model: {e}") from e
    if "ema" in state:
        train_state["ema_state"] = {**train_state["ema_state"], "tensors": state["ema"]}
    rng_file = os.path.join(path, RNG_STATE.format(dist.get_rank()))
    if restore_rng and os.path.isfile(rng_file):
        # A process that did not exist when the checkpoint was written keeps its fresh RNG
        single_file.restore_rng_state(single_file.load_file(rng_file)["rng_state"])


def _masters_from_weights(path, state):
    """AMP O2's fp32 master weights that the folder lacks (an engine that holds the weights in
    fp32 itself wrote it: FSDP2), taken out of ``state``'s optimizer template: parameter name ->
    the template tensor, to fill from the saved fp32 weights rather than from their half copy
    in the model."""
    optim_state = state.get("optimizer", {})
    wanted = [k for k in optim_state if k.startswith("state.") and k.endswith(".master")]
    if not wanted:
        return {}
    with files.guard(path):
        saved = files.reader(path).read_metadata().state_dict_metadata
    masters = {}
    for key in wanted:
        name = key[len("state.") : -len(".master")]
        if f"optimizer.{key}" not in saved and f"model.{name}" in saved:
            masters[name] = optim_state.pop(key)
    return masters


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


def load_full_into(path, state, model, optimizer=None, layout=None):
    """A single-file checkpoint (full tensors) into an FSDP2, tensor-parallel or pipelined model
    (``layout``: the engine's own tensor layout, see above)."""
    own = set(model.state_dict().keys())
    full = {k: v for k, v in state["model_state"].items() if k in own}
    if layout is not None:
        full = layout.convert_state({"model": full}, to_mesh=True)["model"]
    options = StateDictOptions(full_state_dict=True)
    try:
        set_model_state_dict(model, full, options=options)
        if optimizer is not None:
            _materialize_optimizer_state(optimizer)
            named = _optimizer_state_by_name(state["optimizer_state"], model)
            if layout is not None:
                named["state"] = {
                    name: {k: layout.convert(name, v, to_mesh=True) for k, v in fields.items()}
                    for name, fields in named["state"].items()
                }
            set_optimizer_state_dict(model, optimizer, named, options=options)
    except (RuntimeError, KeyError, ValueError) as e:
        raise single_file.CheckpointError(f"checkpoint {path} does not fit this model: {e}") from e


def _optimizer_state_by_name(saved, model):
    """A torch.optim state dict (parameters numbered) keyed by parameter names instead.

    The saved numbering follows the saved optimizer's groups, which were built from the whole
    model the same way (decay, then no-decay, each in parameter order); the numbers are mapped
    through the whole model's names and kept for the parameters this process holds.
    """
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


# ------------------------------------------------------------------------------------------------ #
# Consolidation
# ------------------------------------------------------------------------------------------------ #


def read_model_state(path):
    """The full model state dict of a DCP checkpoint folder, read by this process alone (on the
    host, no collective)."""
    reader = files.reader(path)
    with files.guard(path):
        metadata = reader.read_metadata()
    model = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # one process reading a multi-process folder: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with files.guard(path):
            dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return model


def stored_model_shapes(path, state):
    """Name -> shape of the model tensors a checkpoint holds: of a folder, read from its
    metadata (checked against its files, nothing loaded); of a file, of its ``state`` (as
    ``read_state`` returned it)."""
    if not is_sharded_checkpoint(path):
        return {k: tuple(v.shape) for k, v in (state.get("model_state") or {}).items()}
    with files.guard(path):
        metadata = files.reader(path).read_metadata()
    return {
        key[len("model.") :]: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def consolidate(path, out_file=None):
    """Writes a DCP checkpoint folder as a single-file pycls checkpoint; returns the file's path.

    The result holds the full model state (and train state) and loads with
    ``single_file.load_model_weights`` in one process (TEST.WEIGHTS, TRAIN.WEIGHTS). The optimizer
    state stays in the folder: its numbering depends on how the optimizer was built.
    """
    out_file = out_file or f"{path.rstrip(os.sep)}.pyth"
    files.verify(path)
    model = read_model_state(path)
    state = single_file.load_file(os.path.join(path, TRAIN_STATE))
    state.update(model_state=model, optimizer_state={})
    rng_file = os.path.join(path, RNG_STATE.format(0))
    if os.path.isfile(rng_file):
        state["rng_state"] = single_file.load_file(rng_file)["rng_state"]
    return single_file.save_file(state, out_file)
