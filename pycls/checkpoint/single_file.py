"""One-file checkpoints (``.pyth``): atomic, checksummed, loadable with
``torch.load(weights_only=True)``.

A checkpoint is a plain dict of tensors and Python scalars/containers: model and optimizer state,
grad-scaler state, RNG states, the epoch, and the resolved config as YAML text. Files are written to
a temporary name and renamed, so a crash never leaves a half-written checkpoint under the real name;
a CRC32 over the contents is stored inside, because torch's zip reader does not notice a flipped
byte in tensor data (it loads silently different numbers).
"""

import logging
import os
import random
import re
import zlib

import numpy as np
import torch
from iopath.common.file_io import g_pathmgr

from pycls.atomic_files import atomic_file
from pycls.checkpoint import async_writes, file_kinds
from pycls.checkpoint.files import CheckpointError, guard

_DIR_NAME = "checkpoints"
_NAME_PREFIX = "model_epoch_"
# Epoch checkpoints, mid-epoch ones (a preempted run) and sharded folders (no suffix)
_NAME_RE = re.compile(rf"^{_NAME_PREFIX}(\d+)(?:_iter_(\d+))?(\.pyth)?$")
_CHECKSUM_KEY = "crc32"

logger = logging.getLogger(__name__)


def get_checkpoint_dir(out_dir):
    return os.path.join(out_dir, _DIR_NAME)


def get_checkpoint_path(out_dir, epoch, it=0, sharded=False):
    """Path of the checkpoint written after ``epoch`` (1-based epochs completed).

    ``it`` > 0: a mid-epoch checkpoint (a preempted run) after ``it`` iterations of the next
    epoch. ``sharded``: a torch.distributed.checkpoint folder (pycls.checkpoint.sharded).
    """
    name = f"{_NAME_PREFIX}{epoch:04d}" + (f"_iter_{it:06d}" if it else "")
    return os.path.join(get_checkpoint_dir(out_dir), name if sharded else f"{name}.pyth")


def get_best_checkpoint_path(out_dir):
    """The best weights so far (raw or EMA, whichever evaluated better); not used to resume."""
    return os.path.join(get_checkpoint_dir(out_dir), "model_best.pyth")


def list_checkpoints(out_dir):
    """Checkpoints in OUT_DIR/checkpoints (files and sharded folders), newest first. Only a
    regular file (``.pyth``) or a folder counts: anything else named like one (a FIFO, which
    would block its reader forever, a device, a dangling link) is logged and left alone."""
    d = get_checkpoint_dir(out_dir)
    if not os.path.isdir(d):
        return []
    found = []
    for name in os.listdir(d):
        m = _NAME_RE.match(name)
        if not m:
            continue
        path = os.path.join(d, name)
        if os.path.isfile(path) if m.group(3) is not None else os.path.isdir(path):
            found.append((int(m.group(1)), int(m.group(2) or 0), name))
        else:
            logger.warning(f"{path} is named like a checkpoint but is no regular file or folder")
    return [os.path.join(d, name) for *_, name in sorted(found, reverse=True)]


def get_last_checkpoint(out_dir):
    """Newest checkpoint in OUT_DIR/checkpoints, or None."""
    found = list_checkpoints(out_dir)
    return found[0] if found else None


def _checksum(obj, crc=0):
    """CRC32 over a nested structure of dicts, sequences, tensors and scalars."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"{t.dtype}{tuple(obj.shape)}".encode(), crc)
        return zlib.crc32(t.view(torch.uint8).numpy() if t.numel() else b"", crc)
    if isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            crc = _checksum(obj[key], zlib.crc32(repr(key).encode(), crc))
        return crc
    if isinstance(obj, (list, tuple)):
        crc = zlib.crc32(f"{type(obj).__name__}{len(obj)}".encode(), crc)
        for item in obj:
            crc = _checksum(item, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)


def save_file(state, path, writer=None):
    """Writes ``state`` to ``path`` atomically (temporary file, fsync, rename) with a checksum.
    With ``writer`` (an ``async_writes.Writer``): ``state`` is copied to host memory now and
    written in the background (after the write in flight, if any); returns at once."""
    if writer is None:
        return write_file(state, path)
    staged = writer.stage(state, "file")
    writer.submit(path, lambda: write_file(staged, path))
    return path


def write_file(state, path):
    """``save_file``'s write itself, ``async_writes.STAGES`` marked (nothing visible before the
    rename)."""
    state = dict(state)
    with guard(path, "write"):
        async_writes.fault_point("staged", path)
        state[_CHECKSUM_KEY] = _checksum(state)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_file(path, "wb") as f:
            torch.save(state, _MarkedFile(f, path))
            async_writes.fault_point("before_rename", path)
    return path


class _MarkedFile:
    """A file being written that marks ``mid_write`` after its first write (``fault_point``)."""

    def __init__(self, f, path):
        self._f, self._path, self._marked = f, path, False

    def write(self, data):
        n = self._f.write(data)
        if not self._marked:
            self._marked = True
            async_writes.fault_point("mid_write", self._path)
        return n

    def flush(self):
        self._f.flush()


def load_file(path):
    """Reads and verifies a checkpoint; raises CheckpointError naming the file on any problem."""
    if not g_pathmgr.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if os.path.exists(path) and not os.path.isfile(path):  # local: a FIFO would block the read
        raise CheckpointError(f"checkpoint {path} is not a regular file")
    try:
        with g_pathmgr.open(path, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        why = file_kinds.load_failure(path, e)
        raise CheckpointError(f"checkpoint {path} cannot be read: {why}") from e
    return verified(state, path)


def verified(state, path):
    """``state`` (what ``path`` held, read as data) as a verified checkpoint: its checksum taken
    out and checked; raises CheckpointError when it has none or it does not match."""
    if not isinstance(state, dict) or _CHECKSUM_KEY not in state:
        raise CheckpointError(f"checkpoint {path} is not a pycls checkpoint (no {_CHECKSUM_KEY})")
    stored = state.pop(_CHECKSUM_KEY)
    if _checksum(state) != stored:
        raise CheckpointError(f"checkpoint {path} is corrupt: its contents fail the CRC32 check")
    return state


# ------------------------------------------------------------------------------------------------ #
# RNG state: plain tensors and Python types so weights_only loading accepts them
# ------------------------------------------------------------------------------------------------ #


def capture_rng_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_fields(rng_states):
    """Checkpoint fields for the RNG states of every process (``rng_states[rank]``): each process
    resumes its own streams (dropout, drop-path, mixup draws differ by rank). ``rng_state`` is
    rank 0's, for readers of one process."""
    return {"rng_state": rng_states[0], "rng_states": list(rng_states)}


def restore_own_rng_state(state, rank):
    """Restores process ``rank``'s RNG state from a checkpoint dict. A process the checkpoint has
    no state for (a larger world, or an older checkpoint with rank 0's only) keeps its fresh,
    rank-seeded RNG."""
    states = state.get("rng_states")
    if states is None:
        states = [state["rng_state"]] if "rng_state" in state else []
    if rank < len(states):
        restore_rng_state(states[rank])


# ------------------------------------------------------------------------------------------------ #
# Training state of a model in one piece (engines that split it write their own layout)
# ------------------------------------------------------------------------------------------------ #


def save_checkpoint(
    out_dir,
    epoch,
    *,
    model,
    optimizer,
    cfg_yaml,
    scaler=None,
    extra=None,
    it=0,
    rng_states=None,
    writer=None,
):
    """Writes OUT_DIR/checkpoints/model_epoch_XXXX.pyth after ``epoch`` epochs (and ``it``
    iterations of the next, see get_checkpoint_path) of the plain module ``model``; returns its
    path. ``rng_states``: every process's RNG state (default: this process's alone); ``writer``:
    as ``save_file``'s."""
    state = {
        "epoch": epoch,
        "iter": it,
        "model_state": model.state_dict(),
        "optimizer_state": optimizer.state_dict(),
        "scaler_state": scaler.state_dict() if scaler is not None else {},
        "cfg": cfg_yaml,
        **rng_fields(rng_states or [capture_rng_state()]),
    }
    state.update(extra or {})
    return save_file(state, get_checkpoint_path(out_dir, epoch, it), writer)


def load_model_weights(path, model):
    """Loads only the model weights of a single-file checkpoint into a plain module (for
    TEST.WEIGHTS / TRAIN.WEIGHTS; sharded.load_model_weights reads folders too)."""
    state = load_file(path)
    _load_model_state(path, model, state)
    return state


def _load_model_state(path, model, state):
    module = model  # a bare module: engines unwrap before they call this
    if "model_state" not in state:
        raise CheckpointError(f"checkpoint {path} holds no model_state (keys: {sorted(state)})")
    try:  # the model's load hooks adapt what they can (e.g. resample the position embedding)
        module.load_state_dict(state["model_state"])
    except (RuntimeError, KeyError) as e:
        # torch lists every mismatching tensor, one line each: summarise in one line instead
        why = describe_mismatch(module.state_dict(), state["model_state"])
        why = why or str(e).strip().splitlines()[-1].strip()
        raise CheckpointError(f"checkpoint {path} does not fit this model: {why}") from None


def describe_mismatch(expected, found):
    """One line saying how the state dict ``found`` differs from the model's ``expected`` one
    (shapes, missing and unexpected keys), or "" when it fits."""
    shapes = [k for k in expected if k in found and expected[k].shape != found[k].shape]
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    parts = []
    if shapes:
        k = shapes[0]
        parts.append(
            f"{len(shapes)} tensor(s) of another shape (first: {k} is "
            f"{tuple(found[k].shape)} in the checkpoint, {tuple(expected[k].shape)} in the model)"
        )
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            parts.append(f"{len(keys)} {what} (first: {keys[0]})")
    if not parts:
        return ""
    return "; ".join(parts) + "; was it trained with other VIT.* / MODEL.* settings?"


def load_checkpoint(path, *, model, optimizer=None, scaler=None, restore_rng=True):
    """Restores a plain module, optimizer, scaler and this process's RNG state from a single
    file; returns the whole checkpoint dict."""
    return restore_checkpoint(
        path, load_file(path), model=model, optimizer=optimizer, scaler=scaler,
        restore_rng=restore_rng,
    )  # fmt: skip


def restore_checkpoint(path, state, *, model, optimizer=None, scaler=None, restore_rng=False):
    """Restores from a checkpoint dict already read by ``load_file``; returns it."""
    _load_model_state(path, model, state)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer_state"])
    if scaler is not None and state.get("scaler_state"):
        scaler.load_state_dict(state["scaler_state"])
    if restore_rng:
        restore_own_rng_state(state, 0)
    return state
