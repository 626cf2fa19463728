"""Resuming safely: which checkpoint, whether it still fits the config, and what changed.

- ``find_resumable``: the newest checkpoint that reads and verifies. A newer one that does not
  (truncated, flipped bytes, a crafted folder) is logged with the reason and renamed
  ``*.corrupt`` (never deleted), and the run resumes from the next older one.
- ``check_compatible``: a resume whose config changes the model's shape or the optimizer type
  stops with ``IncompatibleCheckpointError`` naming the checkpoint, the keys and how to start a
  new run from its weights (``TRAIN.WEIGHTS``) instead.
- ``snapshot_hyperparameters`` / ``apply_hyperparameters``: the current config's optimizer
  hyperparameters (weight decay, betas, momentum, eps, ...) replace the restored ones, each change
  logged; the learning rate follows the current schedule anyway.
"""

import functools
import logging
import os

from yacs.config import CfgNode

from pycls import distributed as dist
from pycls.checkpoint import files, sharded, single_file
from pycls.checkpoint.files import CheckpointError

logger = logging.getLogger(__name__)

# Keys that change the model's parameters (names or shapes) or what its weights mean
MODEL_KEYS = (
    "MODEL.TYPE",
    "MODEL.NUM_CLASSES",
    "VIT.PATCH_SIZE",
    "VIT.DEPTH",
    "VIT.WIDTH",
    "VIT.NUM_HEADS",
    "VIT.MLP_DIM",
    "VIT.STEM_TYPE",
    "VIT.C_STEM_CHANNELS",
    "VIT.C_STEM_KERNELS",
    "VIT.C_STEM_STRIDES",
    "VIT.CLASSIFIER",
    "VIT.FFN",
    "VIT.POS_EMBED",
)
# Keys whose change makes the saved optimizer state meaningless
OPTIMIZER_KEYS = ("OPTIM.OPTIMIZER",)
# Group entries that are not hyperparameters (lr follows the schedule every step)
_NOT_HYPER = ("params", "name", "lr", "initial_lr")


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint to resume from was written for another model shape or optimizer type."""


def list_checkpoints(out_dir):
    """Checkpoints in OUT_DIR/checkpoints (files and sharded folders), newest first."""
    d = single_file.get_checkpoint_dir(out_dir)
    if not os.path.isdir(d):
        return []
    found = []
    for name in os.listdir(d):
        m = single_file._NAME_RE.match(name)
        if m and (m.group(3) is not None or os.path.isdir(os.path.join(d, name))):
            found.append((int(m.group(1)), int(m.group(2) or 0), name))
    return [os.path.join(d, name) for *_, name in sorted(found, reverse=True)]


def _set_aside(path):
    """Renames a bad checkpoint to ``path.corrupt`` (``.corrupt.N`` if that exists)."""
    target, n = f"{path}.corrupt", 1
    while os.path.exists(target):
        target, n = f"{path}.corrupt.{n}", n + 1
    os.replace(path, target)
    return target


def find_resumable(out_dir):
    """(path, train state) of the newest checkpoint that verifies, or (None, None).

    Every process reads and chooses alike; rank 0 then renames the bad newer ones.
    """
    bad, found = [], (None, None)
    for path in list_checkpoints(out_dir):
        try:
            found = (path, sharded.read_state(path))
            break
        except CheckpointError as e:
            logger.error(f"cannot resume from {path}: {e}")
            bad.append(path)
    if bad:
        dist.barrier()  # everybody has chosen before anything is renamed
        if dist.is_main_proc():
            for path in bad:
                target = _set_aside(path)
                logger.error(f"renamed the unreadable checkpoint {path} to {target}")
            older = found[0] or "nothing (training starts from scratch)"
            logger.error(f"resuming from {older}")
        dist.barrier()
    return found


def _stored_cfg(path, state):
    text = state.get("cfg")
    if not text:
        return None
    try:
        return CfgNode.load_cfg(text)
    except Exception as e:  # written by another pycls version: nothing to compare against
        logger.warning(f"{path}: its stored config cannot be read ({e}); settings not compared")
        return None


def _changed(old, new, keys):
    out = []
    for key in keys:
        try:
            before, after = _get(old, key), _get(new, key)
        except KeyError:
            continue
        if _norm(before) != _norm(after):
            out.append((key, before, after))
    return out


def _get(cfg, key):
    """The value of a dotted key; KeyError when the config (an older one) has no such key."""
    return functools.reduce(lambda node, part: node[part], key.split("."), cfg)


def _norm(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def check_compatible(path, state, cfg):
    """Raises IncompatibleCheckpointError when the model or optimizer type changed since ``path``
    was written; logs every other OPTIM change (applied from the current config)."""
    old = _stored_cfg(path, state)
    if old is None:
        return
    bad = _changed(old, cfg, MODEL_KEYS + OPTIMIZER_KEYS)
    if bad:
        what = ", ".join(f"{k}: {b!r} -> {a!r}" for k, b, a in bad)
        raise IncompatibleCheckpointError(
            f"cannot resume from checkpoint {path}: the config changed {what} since it was "
            "written, which changes the model's shape or the optimizer's state. Resume with the "
            "checkpoint's values, or start a new run from its weights: another OUT_DIR and "
            f"TRAIN.WEIGHTS {path}"
        )
    optim_keys = [f"OPTIM.{k}" for k in cfg.OPTIM if f"OPTIM.{k}" not in OPTIMIZER_KEYS]
    for key, before, after in _changed(old, cfg, optim_keys):
        logger.info(f"resume: {key} changed since {path}: {before!r} -> {after!r} (applied)")


def snapshot_hyperparameters(optimizer):
    """The hyperparameters of each parameter group, as the current config built them."""
    return [{k: v for k, v in g.items() if k not in _NOT_HYPER} for g in optimizer.param_groups]


def apply_hyperparameters(optimizer, fresh, path):
    """Puts the current config's hyperparameters (``fresh``, from ``snapshot_hyperparameters``
    before the restore) back into the restored groups; logs each value that differed."""
    if len(fresh) != len(optimizer.param_groups):
        logger.warning(f"{path}: parameter groups differ in number; hyperparameters as restored")
        return
    for i, (group, now) in enumerate(zip(optimizer.param_groups, fresh)):
        name = group.get("name", i)
        for key, value in now.items():
            if _norm(group.get(key)) != _norm(value):
                logger.info(
                    f"resume: optimizer group {name!r}: {key} {group.get(key)!r} -> {value!r} "
                    "(from the current config)"
                )
                group[key] = value


def remove_stale_temporaries(out_dir):
    """Removes the temporary files and folders of checkpoint writes that died (call it while
    holding the OUT_DIR lock: then no live writer owns them)."""
    for path in files.remove_stale_temporaries(single_file.get_checkpoint_dir(out_dir)):
        logger.info(f"removed {path}, left by a checkpoint write that did not finish")
