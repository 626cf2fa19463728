"""Where a training run resumes, decided in one place: the newest checkpoint that verifies
(``pycls.checkpoint.resume``), held to the config (``pycls.core.resume_checks``: the model's
shape, the optimizer type), to the teacher and to the data plan that drew its unfinished epoch;
the answer is a ``ResumePoint`` that ``Trainer`` applies. And the other way round,
``checkpoint_extra``: what every checkpoint records of the trainer so that a resume finds that
point again (its place in the epoch's sample order, the best errors, the image size, ...).

The functions read the ``Trainer``'s data plan (curriculum sizes, the training dataset and its
sampler), its evaluator, teacher and EMA; nothing here loads a tensor into it.
"""

import dataclasses

from pycls import config
from pycls import distributed as dist
from pycls.checkpoint import resume
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
    resume_checks.check_compatible(path, state, cfg)  # model shape, optimizer type
    teacher = trainer.step.teacher
    check_teacher(cfg, path, state, teacher.identity if teacher is not None else None)
    epoch = state["epoch"]
    # A token budget's unfinished epoch first needs the plan that drew it (its message names the
    # TRAIN.TOKEN_* keys, where the position's would name the batch size)
    if (state.get("position") or {}).get("samples", state.get("iter", 0)):
        check_token_plan(path, state, token_plan(trainer))
    # > 0: stopped (preempted) mid-epoch; counted in the current batch size
    steps = resume.steps_done(path, state, position(trainer, epoch, 0))
    im_size = state.get("im_size", cfg.TRAIN.IM_SIZE)
    best = state.get("best", trainer.best)
    return ResumePoint(path, state, epoch, steps, im_size, best, state.get("min_top1_err", {}))


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
