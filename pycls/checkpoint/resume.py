"""Resuming safely: which checkpoint, whether it still fits the config, and what changed.

- ``find_checkpoint``: the checkpoint a path given by the user stands for (a run folder or its
  checkpoints/ folder: the newest one there); ``prune_checkpoints``: only the newest N kept.
- ``find_resumable``: the newest checkpoint that reads and verifies. A newer one that does not
  (truncated, flipped bytes, a crafted folder) is logged with the reason and renamed
  ``*.corrupt`` (never deleted), and the run resumes from the next older one.
- ``refuse_changes``: a resume whose config changes the model's shape or the optimizer type
  stops with ``IncompatibleCheckpointError`` naming the checkpoint, the keys and how to start a
  new run from its weights (``TRAIN.WEIGHTS``) instead (``pycls.core.resume_checks`` says which
  changes those are).
- ``snapshot_hyperparameters`` / ``apply_hyperparameters``: the current config's optimizer
  hyperparameters (weight decay, betas, momentum, eps, ...) replace the restored ones, each change
  logged; the learning rate follows the current schedule anyway.
- ``epoch_position`` / ``steps_done``: where in its epoch a checkpoint stopped, in samples of the
  epoch's order; a resume with another batch size, accumulation or number of processes trains
  exactly the samples the epoch has left, each once, or is refused naming the key (each change
  logged).
"""

import logging
import os
import shutil

from pycls import distributed as dist
from pycls.checkpoint import files, sharded, single_file
from pycls.checkpoint.files import CheckpointError
from pycls.errors import UserError

logger = logging.getLogger(__name__)

# Group entries that are not hyperparameters (lr follows the schedule every step)
_NOT_HYPER = ("params", "name", "lr", "initial_lr")


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint to resume from was written for another model shape or optimizer type."""


class ChangedEpochError(IncompatibleCheckpointError, UserError):
    """A mid-epoch resume whose settings cannot train exactly the samples the epoch has left."""


def epoch_position(
    samples, samples_per_step, accum, world_size, num_samples, seed, repeats, order="global"
):
    """What a checkpoint records of its place in the epoch: ``samples`` of the epoch's order
    trained (all processes together) and the settings that drew and split that order (``order``:
    the sampler's ``order_settings()``, "global" for one permutation of every sample)."""
    return {
        "samples": samples,
        "samples_per_step": samples_per_step,
        "accum": accum,
        "world_size": world_size,
        "num_samples": num_samples,
        "seed": seed,
        "repeats": repeats,
        "order": order,
    }


# What each recorded setting is called in the config, for the log and the errors
_POSITION_KEYS = {
    "samples_per_step": "TRAIN.BATCH_SIZE",
    "accum": "TRAIN.ACCUM_STEPS",
    "world_size": "processes",
    "num_samples": "training images",
    "seed": "RNG_SEED",
    "repeats": "TRAIN.REPEATED_AUG",
    "order": "DATA_LOADER.ORDER (with SHUFFLE_BUFFER and the shards' lengths)",
}
# Settings that draw another order for the epoch: the samples trained so far are not a prefix
_ORDER = ("num_samples", "seed", "repeats", "order")
# What a checkpoint of an older pycls, which did not record a setting, had
_RECORDED_BEFORE = {"order": "global"}


def steps_done(path, state, now):
    """Optimizer steps of the resumed epoch already trained, in the current settings ``now``
    (an ``epoch_position`` with samples 0). Logs every setting that changed since ``path``;
    raises ChangedEpochError naming the key when the rest of a stopped epoch cannot be trained
    exactly (each remaining sample once) under the current ones."""
    saved, it = state.get("position"), state.get("iter", 0)
    if saved is None:  # written by an older pycls: nothing recorded to compare
        return it
    saved = {**_RECORDED_BEFORE, **saved}
    for key, name in _POSITION_KEYS.items():
        if saved.get(key) != now[key]:
            logger.info(f"resume: {name} changed since {path}: {saved.get(key)} -> {now[key]}")
    samples = saved["samples"]
    if samples == 0:  # stopped at an epoch boundary: any settings start the next epoch afresh
        return 0
    where = f"{path} stopped {samples} samples into epoch {state['epoch'] + 1}"
    for key in _ORDER:
        if saved.get(key) != now[key]:
            raise ChangedEpochError(
                f"{_POSITION_KEYS[key]}: {saved.get(key)} -> {now[key]}, but {where}, whose order "
                "that setting drew: resume with the checkpoint's value to finish the epoch"
            )
    if samples % now["samples_per_step"]:
        raise ChangedEpochError(
            f"TRAIN.BATCH_SIZE: {now['samples_per_step']} does not divide the {samples} samples "
            f"already trained ({where} with batch {saved['samples_per_step']}), so the rest of "
            "the epoch cannot be trained in whole steps: resume with a batch that divides it "
            "(the checkpoint's, for one) until the epoch ends"
        )
    done = samples // now["samples_per_step"]
    if (
        saved["samples_per_step"] != now["samples_per_step"]
        or saved["world_size"] != now["world_size"]
    ):
        logger.info(f"resume: {where}; the rest of it is trained from step {done + 1}")
    return done


def find_checkpoint(path, what):
    """The checkpoint ``path`` stands for: itself when it is a checkpoint file or a sharded
    checkpoint folder; for a run folder (OUT_DIR) or its checkpoints/ folder, the newest
    checkpoint there, logged. ``what`` names the setting in messages (TEST.WEIGHTS, ...); a folder
    holding no checkpoint is a CheckpointError saying what to give instead."""
    if not os.path.isdir(path) or _is_sharded_folder(path):
        return path
    folder = os.path.normpath(path)
    is_ckpt_dir = os.path.basename(folder) == os.path.basename(single_file.get_checkpoint_dir(""))
    run_dir = os.path.dirname(folder) if is_ckpt_dir else folder
    found = single_file.list_checkpoints(run_dir)
    if not found:
        final = os.path.join(run_dir, "model_final.safetensors")
        hint = f"; its final weights are {final}" if os.path.isfile(final) else ""
        raise CheckpointError(
            f"{what}: {path} is a folder holding no checkpoint (checkpoints/model_epoch_*){hint}; "
            "give a checkpoint file, e.g. OUT_DIR/checkpoints/model_epoch_0040.pyth"
        )
    logger.info(f"{what}: {path} is a folder: using its newest checkpoint, {found[0]}")
    return found[0]


def prune_checkpoints(out_dir, keep):
    """Removes all but the ``keep`` newest epoch checkpoints of OUT_DIR/checkpoints (files and
    sharded folders; ``keep`` 0 keeps all). model_best.pyth and model_final.safetensors have
    other names and stay. Returns the removed paths."""
    removed = single_file.list_checkpoints(out_dir)[keep:] if keep > 0 else []
    for path in removed:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        logger.info(f"removed {path} (TRAIN.KEEP_CHECKPOINTS {keep})")
    return removed


def _is_sharded_folder(path):
    """A torch.distributed.checkpoint folder as pycls writes it (or any DCP folder)."""
    return any(os.path.exists(os.path.join(path, n)) for n in (sharded.TRAIN_STATE, ".metadata"))


def _set_aside(path):
    """Renames a bad checkpoint to ``path.corrupt`` (``.corrupt.N`` if that exists)."""
    target, n = f"{path}.corrupt", 1
    while os.path.exists(target):
        target, n = f"{path}.corrupt.{n}", n + 1
    os.replace(path, target)
    return target


def find_resumable(out_dir, allow_unverified=False):
    """(path, train state) of the newest checkpoint that verifies, or (None, None).

    Every process reads and chooses alike; rank 0 then renames the bad newer ones.
    """
    bad, found = [], (None, None)
    for path in single_file.list_checkpoints(out_dir):
        try:
            found = (path, sharded.read_state(path, allow_unverified))
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


def refuse_changes(path, changed):
    """Raises IncompatibleCheckpointError naming ``path`` and each ``(key, before, after)`` of
    ``changed``: settings that change the model's shape or the optimizer's state since the
    checkpoint was written (the caller, which knows the config, works them out)."""
    if not changed:
        return
    what = ", ".join(f"{k}: {b!r} -> {a!r}" for k, b, a in changed)
    raise IncompatibleCheckpointError(
        f"cannot resume from checkpoint {path}: the config changed {what} since it was "
        "written, which changes the model's shape or the optimizer's state. Resume with the "
        "checkpoint's values, or start a new run from its weights: another OUT_DIR and "
        f"TRAIN.WEIGHTS {path}"
    )


def _norm(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def snapshot_hyperparameters(optimizer):
    """The hyperparameters of each parameter group, as the current config built them: not what
    an optimizer counts in its groups as it steps (its ``running_group_keys``, e.g.
    Schedule-Free's step count and averaging weights), which the checkpoint restores."""
    skip = (*_NOT_HYPER, *getattr(optimizer, "running_group_keys", ()))
    return [{k: v for k, v in g.items() if k not in skip} for g in optimizer.param_groups]


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
    """Removes the temporary files and folders of writes that died: checkpoints, and the
    ``*.tmp.PID`` files of every atomic writer in OUT_DIR (model_final, config.yaml, exports)
    whose process is gone. Call it while holding the OUT_DIR lock: then no live run owns them."""
    removed = files.remove_stale_temporaries(single_file.get_checkpoint_dir(out_dir))
    removed += files.remove_dead_writers_files(out_dir)
    for path in removed:
        logger.info(f"removed {path}, left by a write that did not finish")
