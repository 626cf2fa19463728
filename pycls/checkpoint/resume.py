"""Resuming safely: which checkpoint a run or a path stands for, and what it records.

- ``find_checkpoint``: the checkpoint a path given by the user stands for (a run folder or its
  checkpoints/ folder: the newest one there); ``prune_checkpoints``: only the newest N kept.
- ``find_resumable``: the newest checkpoint that reads and verifies. A newer one that does not
  (truncated, flipped bytes, a crafted folder) is logged with the reason and renamed
  ``*.corrupt`` (never deleted), and the run resumes from the next older one.
- ``epoch_position``: what a checkpoint records of where in its epoch it stopped, in samples of
  the epoch's order, and the settings that drew that order;
- ``IncompatibleCheckpointError`` / ``ChangedEpochError``: a resume the checkpoint does not allow.

Whether a checkpoint still fits the config, where in its epoch the run goes on and what the
trainer restores are decided in one place above this one, ``pycls.core.resume_point``, which
calls down here and nowhere back.
"""

import logging
import os
import shutil

from pycls import distributed as dist
from pycls.checkpoint import files, sharded, single_file
from pycls.checkpoint.files import CheckpointError
from pycls.errors import UserError

logger = logging.getLogger(__name__)


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


def remove_stale_temporaries(out_dir):
    """Removes the temporary files and folders of writes that died: checkpoints, and the
    ``*.tmp.PID`` files of every atomic writer in OUT_DIR (model_final, config.yaml, exports)
    whose process is gone. Call it while holding the OUT_DIR lock: then no live run owns them."""
    removed = files.remove_stale_temporaries(single_file.get_checkpoint_dir(out_dir))
    removed += files.remove_dead_writers_files(out_dir)
    for path in removed:
        logger.info(f"removed {path}, left by a write that did not finish")
