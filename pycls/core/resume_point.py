"""Where a training run resumes, decided in one place: the newest checkpoint that verifies
(``pycls.checkpoint.resume``), held to the config (``pycls.core.resume_checks``: the model's
shape, the optimizer type), to the teacher and to the data plan that drew its unfinished epoch;
the answer is a ``ResumePoint`` that ``Trainer`` applies. And the other way round,
``checkpoint_extra``: what every checkpoint records of the trainer so that a resume finds that
point again (its place in the epoch's sample order, the best errors, the image size, ...).

The functions read the ``Trainer``'s data plan (curriculum sizes, the training dataset and its
sampler), its evaluator, teacher and EMA; nothing here loads a tensor into it. The checkpoint is
read once, below (``pycls.checkpoint``: which file, verified, and whether it is a sharded
folder); every decision about it is then taken here (its steps into the epoch,
``steps_done``; the current config's optimizer hyperparameters put back after the engine
restored it, ``apply_hyperparameters``), none handed back down to be looked at again.
"""

import dataclasses

from pycls import config
from pycls import distributed as dist
from pycls.checkpoint import resume, sharded
from pycls.core import logging as logs
from pycls.core import resume_checks

logger = logs.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """A checkpoint to resume from and where it leaves the run."""

    path: str
    state: dict  # its train state (``sharded.read_state``), which the engine loads
    epoch: int  # epochs completed
    steps: int  # optimizer steps of the next epoch already trained, in the current batch size
    im_size: int  # the image size trained last: a curriculum's model switches to it first
    best: dict  # the best evaluation so far (what model_best.pyth holds)
    min_top1_err: dict  # the evaluator's best top-1 error per json_stats type
    folder: bool  # a sharded checkpoint folder (else one file): decided where it was opened

    def announce(self):
        """The resume's log line and json_stats record."""
        logger.info(f"resumed from {self.path} (epoch {self.epoch})")
        it = self.state.get("iter", 0)  # the stopped attempt's steps, as it logged them
        logs.log_json_stats({"_type": "resume", "epoch": self.epoch, "iter": it,
                             "checkpoint": self.path})  # fmt: skip


def find(trainer):
    """The point ``trainer``'s run resumes from: with TRAIN.AUTO_RESUME, the newest checkpoint
    that verifies (bad newer ones renamed ``*.corrupt``), or None to start afresh. Raises naming
    the key when the checkpoint does not fit the config, the teacher or the epoch's plan."""
    cfg = trainer.cfg
    if not cfg.TRAIN.AUTO_RESUME:
        return None
    path, state = resume.find_resumable(cfg.OUT_DIR, cfg.ALLOW_UNVERIFIED_CHECKPOINTS)
    if not path:
        return None
    folder = sharded.is_sharded_checkpoint(path)  # its kind, decided once: the engine reads by it
    resume_checks.check_compatible(path, state, cfg)  # model shape, optimizer type
    teacher = trainer.step.teacher
    check_teacher(cfg, path, state, teacher.identity if teacher is not None else None)
    epoch = state["epoch"]
    # A token budget's unfinished epoch first needs the plan that drew it (its message names the
    # TRAIN.TOKEN_* keys, where the position's would name the batch size)
    if (state.get("position") or {}).get("samples", state.get("iter", 0)):
        check_token_plan(path, state, token_plan(trainer))
    # > 0: stopped (preempted) mid-epoch; counted in the current batch size
    steps = steps_done(path, state, position(trainer, epoch, 0))
    im_size = state.get("im_size", cfg.TRAIN.IM_SIZE)
    best = state.get("best", trainer.best)
    errors = state.get("min_top1_err", {})
    return ResumePoint(path, state, epoch, steps, im_size, best, errors, folder)


def position(trainer, epoch, steps):
    """Where ``steps`` optimizer steps into ``epoch`` are in the epoch's sample order."""
    n, t, world = trainer.sizes.batch_size(epoch), trainer.cfg.TRAIN, dist.get_world_size()
    num_samples, order = len(trainer.train_dataset), trainer.train_loader.sampler.order_settings()
    return resume.epoch_position(steps * n, n, t.ACCUM_STEPS, world, num_samples,
                                 trainer.cfg.RNG_SEED, t.REPEATED_AUG, order)  # fmt: skip


def token_plan(trainer):
    """What draws a token budget's epoch plan besides seed and epoch (None without one)."""
    signature = getattr(trainer.train_loader.sampler, "signature", None)
    return signature() if signature is not None else None


def check_token_plan(path, state, now):
    """A token budget's epoch stopped midway resumes only under the plan that drew it (``now``):
    the micro-batches trained are skipped by count."""
    saved = state.get("token_plan")
    if saved != now:
        raise resume.ChangedEpochError(
            f"TRAIN.TOKEN_BUDGET: the token batches of {path}'s unfinished epoch were planned "
            f"with {saved}, now {now}: resume with the checkpoint's TRAIN.TOKEN_* settings, "
            "processes and TRAIN.ACCUM_STEPS to finish the epoch"
        )


def check_teacher(cfg, path, state, now):
    """A resume distils from the teacher the checkpoint was trained with (the SHA-256 of its
    weights; ``now``: the current teacher's identity), unless DISTILL.ALLOW_TEACHER_CHANGE says
    another one may take over."""
    saved = state.get("teacher")
    if not saved or not now or saved.get("sha256") == now.get("sha256"):
        return
    change = (
        f"the teacher's weights differ from those {path} was trained with: then "
        f"{saved.get('file')} (sha256 {saved.get('sha256')}), now {now['file']} (sha256 "
        f"{now['sha256']})"
    )
    if not cfg.DISTILL.ALLOW_TEACHER_CHANGE:
        raise config.ConfigError(
            f"DISTILL.TEACHER: {change}; resume with that teacher, or set "
            "DISTILL.ALLOW_TEACHER_CHANGE True to go on with this one"
        )
    logger.warning(f"DISTILL.TEACHER: {change}; going on with the new one")


def checkpoint_extra(trainer, epoch, it):
    """What a checkpoint after ``epoch`` epochs and ``it`` steps records beyond the model,
    optimizer and scaler, for ``find`` to read back."""
    extra = {
        "position": position(trainer, epoch, it),
        "min_top1_err": dict(trainer.evaluator.min_top1_err),
        "best": dict(trainer.best),
        "im_size": trainer.engine.image_size,
        "classes": trainer.classes,
    }
    if trainer.ema is not None:
        extra["ema_state"] = trainer.ema.state_dict()
    if token_plan(trainer) is not None:
        extra["token_plan"] = token_plan(trainer)
    if trainer.step.teacher is not None:  # which teacher trained the run
        extra["teacher"] = trainer.step.teacher.identity
    return extra


# ---- where in its epoch a stopped run goes on --------------------------------------------------

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
            raise resume.ChangedEpochError(
                f"{_POSITION_KEYS[key]}: {saved.get(key)} -> {now[key]}, but {where}, whose order "
                "that setting drew: resume with the checkpoint's value to finish the epoch"
            )
    if samples % now["samples_per_step"]:
        raise resume.ChangedEpochError(
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


# ---- the optimizer's hyperparameters: the current config's, after the restore ----------------

# Group entries that are not hyperparameters (lr follows the schedule every step)
_NOT_HYPER = ("params", "name", "lr", "initial_lr")


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
