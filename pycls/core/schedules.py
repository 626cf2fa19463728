"""Learning-rate schedules as functions of a fractional epoch, evaluated every iteration."""

import bisect
import math


class LRSchedule:
    """lr(epoch) for a fractional epoch: warmup, then cos / lin / steps / constant.

    Warmup multiplies the schedule by a factor rising linearly from ``warmup_factor`` to 1 over
    ``warmup_epochs``, so the rate joins the schedule without a jump.
    """

    def __init__(
        self,
        *,
        base_lr,
        max_epoch,
        policy="cos",
        min_lr=0.0,
        steps=(),
        lr_mult=0.1,
        warmup_epochs=0.0,
        warmup_factor=0.01,
    ):
        if policy not in ("cos", "lin", "steps", "constant"):
            raise ValueError(f"LR policy {policy!r} is not one of cos, lin, steps, constant")
        self.base_lr, self.min_lr, self.max_epoch = base_lr, min_lr, max_epoch
        self.policy, self.steps, self.lr_mult = policy, list(steps), lr_mult
        self.warmup_epochs, self.warmup_factor = warmup_epochs, warmup_factor

    def _policy(self, epoch):
        t = min(max(epoch / self.max_epoch, 0.0), 1.0)
        span = self.base_lr - self.min_lr
        if self.policy == "cos":
            return self.min_lr + span * 0.5 * (1.0 + math.cos(math.pi * t))
        if self.policy == "lin":
            return self.base_lr - span * t
        if self.policy == "steps":
            return self.base_lr * self.lr_mult ** bisect.bisect_right(self.steps, epoch)
        return self.base_lr

    def __call__(self, epoch):
        lr = self._policy(epoch)
        if epoch < self.warmup_epochs:
            alpha = epoch / self.warmup_epochs
            lr *= self.warmup_factor * (1.0 - alpha) + alpha
        return lr


def lr_schedule_from_cfg(cfg, global_batch_size=None):
    """The schedule that OPTIM describes, with the linear scaling rule applied if configured."""
    o = cfg.OPTIM
    scale = 1.0
    if o.LR_SCALE_BATCH > 0:
        scale = (global_batch_size or cfg.TRAIN.BATCH_SIZE) / o.LR_SCALE_BATCH
    return LRSchedule(
        base_lr=o.BASE_LR * scale,
        min_lr=o.MIN_LR * scale,
        max_epoch=o.MAX_EPOCH,
        policy=o.LR_POLICY,
        steps=o.STEPS,
        lr_mult=o.LR_MULT,
        warmup_epochs=o.WARMUP_EPOCHS,
        warmup_factor=o.WARMUP_FACTOR,
    )


def set_lr(optimizer, lr):
    """Sets the rate of every parameter group (groups may carry an ``lr_scale``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
