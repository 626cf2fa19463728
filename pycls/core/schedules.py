"""Schedules as functions of the (fractional) epoch: the learning rate and the image size."""

import bisect
import math

from pycls.optim.optimizer_options import LR_POLICIES


class LRSchedule:
    """lr(epoch) for a fractional epoch: warmup, then cos / lin / steps / constant.

    Warmup multiplies the schedule by a factor rising linearly from ``warmup_factor`` to 1 over
    ``warmup_epochs`` (or ``warmup_steps`` optimizer steps of ``steps_per_epoch`` each), so the
    rate joins the schedule without a jump. The decay of cos, lin and onecycle spans the whole
    run, or with ``warmup_prefix`` only what follows the warmup: it starts at ``base_lr`` where
    the warmup ends (big_vision's schedule; timm's ``warmup_prefix``).
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
        onecycle_pct_start=0.3,
        onecycle_div_factor=25.0,
        cycle_epochs=10.0,
        warmup_steps=0,
        steps_per_epoch=1,
        warmup_prefix=False,
    ):
        if policy not in LR_POLICIES:
            raise ValueError(f"LR policy {policy!r} is not one of {list(LR_POLICIES)}")
        self.base_lr, self.min_lr, self.max_epoch = base_lr, min_lr, max_epoch
        self.policy, self.steps, self.lr_mult = policy, list(steps), lr_mult
        if warmup_steps:
            warmup_epochs = warmup_steps / steps_per_epoch
        self.warmup_epochs, self.warmup_factor = warmup_epochs, warmup_factor
        self.warmup_prefix = warmup_prefix
        self.pct_start, self.div_factor = onecycle_pct_start, onecycle_div_factor
        self.cycle_epochs = cycle_epochs

    def _progress(self, epoch):
        """The fraction of the decay done at ``epoch``, in [0, 1]."""
        start = self.warmup_epochs if self.warmup_prefix else 0.0
        if self.max_epoch <= start:
            return 1.0 if epoch >= start else 0.0
        return min(max((epoch - start) / (self.max_epoch - start), 0.0), 1.0)

    def _policy(self, epoch):
        t = self._progress(epoch)
        span = self.base_lr - self.min_lr
        if self.policy == "cos":
            return self.min_lr + span * 0.5 * (1.0 + math.cos(math.pi * t))
        if self.policy == "lin":
            return self.base_lr - span * t
        if self.policy == "steps":
            return self.base_lr * self.lr_mult ** bisect.bisect_right(self.steps, epoch)
        if self.policy == "onecycle":
            return self._onecycle(t)
        if self.policy == "cyclic":
            phase = (epoch / self.cycle_epochs) % 1.0
            return self.min_lr + span * (1.0 - abs(2.0 * phase - 1.0))
        return self.base_lr

    def _onecycle(self, t):
        """Cosine rise from base_lr / div_factor to base_lr over pct_start, then fall to min_lr."""
        start = self.base_lr / self.div_factor
        if t < self.pct_start:
            a = t / self.pct_start
            return start + (self.base_lr - start) * 0.5 * (1.0 - math.cos(math.pi * a))
        a = (t - self.pct_start) / max(1.0 - self.pct_start, 1e-12)
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * a))

    def __call__(self, epoch):
        lr = self._policy(epoch)
        if epoch < self.warmup_epochs:
            alpha = epoch / self.warmup_epochs
            lr *= self.warmup_factor * (1.0 - alpha) + alpha
        return lr


def set_lr(optimizer, lr):
    """Sets the rate of every parameter group (groups may carry an ``lr_scale``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


class ImageSizeCurriculum:
    """Training image size per epoch: ``start``, growing by ``step`` every ``epochs_per_step``
    epochs up to ``final`` ("Training a ViT from scratch in less than 24 hours with 1 GPU").

    With ``scale_batch``, the batch grows as the image shrinks so that tokens per batch stay about
    constant: batch(size) = base_batch * (final / size)^2, rounded down to a multiple of
    ``batch_multiple`` (the process count times the accumulation steps).
    """

    def __init__(
        self,
        *,
        start,
        step,
        epochs_per_step,
        final,
        base_batch,
        scale_batch=False,
        batch_multiple=1,
    ):
        if start > final:
            raise ValueError(f"curriculum start size {start} exceeds the final size {final}")
        self.start, self.step, self.epochs_per_step, self.final = (
            start,
            step,
            epochs_per_step,
            final,
        )
        self.base_batch, self.scale_batch, self.batch_multiple = (
            base_batch,
            scale_batch,
            batch_multiple,
        )

    def size(self, epoch):
        return min(self.start + (epoch // self.epochs_per_step) * self.step, self.final)

    def batch_size(self, epoch):
        if not self.scale_batch:
            return self.base_batch
        scaled = int(self.base_batch * (self.final / self.size(epoch)) ** 2)
        return max(scaled // self.batch_multiple * self.batch_multiple, self.batch_multiple)


class FixedImageSize:
    """No curriculum: TRAIN.IM_SIZE and TRAIN.BATCH_SIZE every epoch."""

    def __init__(self, size, batch):
        self.final, self.base_batch = size, batch

    def size(self, epoch):
        return self.final

    def batch_size(self, epoch):
        return self.base_batch


class PatchDropSchedule:
    """The patch-dropout rate per epoch (VIT.PATCH_DROP*): ``rate`` every epoch ("constant"), or
    tied to the image-size schedule ``sizes`` ("curriculum"): the rate at each epoch's size and
    batch that keeps a batch's patch tokens where ``rate`` keeps them at the final size, so that
    the smaller images of the early epochs drop fewer patches, or none. From ``off_epoch`` on
    (0: never) every patch is kept, FLIP's unmasked tuning."""

    def __init__(self, rate, *, schedule="constant", sizes=None, patch_size=16, off_epoch=0):
        if schedule not in ("constant", "curriculum"):
            raise ValueError(f"unknown patch-drop schedule {schedule!r}")
        if schedule == "curriculum" and sizes is None:
            raise ValueError("the curriculum patch-drop schedule needs the image-size schedule")
        self.rate, self.schedule, self.sizes = rate, schedule, sizes
        self.patch_size, self.off_epoch = patch_size, off_epoch

    def __call__(self, epoch):
        if self.rate == 0 or (self.off_epoch and epoch >= self.off_epoch):
            return 0.0
        if self.schedule == "constant":
            return self.rate
        sizes, p = self.sizes, self.patch_size
        final_tokens = sizes.base_batch * (sizes.final // p) ** 2
        tokens = sizes.batch_size(epoch) * (sizes.size(epoch) // p) ** 2
        if tokens == final_tokens:
            return self.rate
        return max(0.0, 1.0 - (1.0 - self.rate) * final_tokens / tokens)
