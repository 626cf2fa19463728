"""The one training step: what the trainer's loop runs for every optimizer step, and what
``--mode time``, the learning-rate finder and the profiler run, so that every speed or loss
figure pycls reports comes from the step that trains.

One step: the learning rate set on every parameter group, the gradients cleared, then
ACCUM_STEPS micro-batches each mixed (mixup / cutmix, when on), predicted by the teacher (when
distilling) and run forward and backward by the engine (gradients synchronised across processes
on the last one only), then the engine's step (unscale, clip, optimizer step, loss-scale update),
the EMA update and the meters' step count. The host waits for the device nowhere in it.
"""

import contextlib

import torch
from torch import nn

from pycls.core.schedules import set_lr
from pycls.distributed.watchdog import NO_WATCHDOG
from pycls.engines.precision import DynamicLossScaler
from pycls.optim.library_optimizers import evaluation_weights


class RunningStatsGuard:
    """The batch-norm running statistics of a model, kept before each float16 step and put back
    when the loss scaler skips the step: a batch whose forward pass overflowed (or held NaN)
    updates them in the forward pass already, and a skipped step must leave no trace (else
    the model keeps NaN statistics and predicts one class)."""

    def __init__(self, module):
        self.buffers = [
            b
            for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]
        self.saved = [b.detach().clone() for b in self.buffers]

    @torch.no_grad()
    def save(self):
        for saved, buf in zip(self.saved, self.buffers):
            saved.copy_(buf)

    @torch.no_grad()
    def restore(self):
        for saved, buf in zip(self.saved, self.buffers):
            buf.copy_(saved)


class TrainingStep:
    """One optimizer step of a configured training: build it with
    ``pycls.core.builders.build_training_step`` (or by hand from plain arguments).

    ``engine``: the engine handle holding the model; ``optimizer``, ``scaler``, ``loss_fn`` as the
    trainer builds them; ``accum_steps`` micro-batches per step; ``clip_grad`` the global gradient
    norm to clip to (0: off); ``mixer`` a BatchMixer (None: no mixing); ``ema`` a ModelEMA (None:
    off); ``count_tokens`` a function of a micro-batch's images giving the token positions the
    model computes for it, from host numbers (``pycls.models.vit.token_masks.computed_tokens``), for
    the meter (None: not counted); ``teacher`` a ``pycls.core.distillation.Teacher`` (None: no
    distillation), whose logits of each micro-batch (as mixed) ``loss_fn``, then a
    ``DistillationLoss``, takes beside the student's outputs and the targets.
    """

    def __init__(
        self,
        engine,
        optimizer,
        scaler,
        loss_fn,
        *,
        accum_steps=1,
        clip_grad=0.0,
        mixer=None,
        ema=None,
        count_tokens=None,
        teacher=None,
    ):
        self.engine, self.optimizer, self.scaler, self.loss_fn = engine, optimizer, scaler, loss_fn
        self.accum_steps, self.clip_grad = accum_steps, clip_grad
        self.mixer, self.ema, self.teacher = mixer, ema, teacher
        self.count_tokens = count_tokens
        self._running_stats = None  # a RunningStatsGuard under float16 loss scaling, if any BN
        # The training run's hang watchdog (pycls.distributed.watchdog): marked before each
        # micro-batch's collectives and after each step
        self.watchdog = NO_WATCHDOG

    def _guard(self):
        if not isinstance(self.scaler, DynamicLossScaler):
            return None
        if self._running_stats is None:
            self._running_stats = RunningStatsGuard(self.engine.module)
        return self._running_stats if self._running_stats.buffers else None

    def __call__(self, batches, lr, mixing=False, meter=None):
        """Runs one step on the next ``accum_steps`` micro-batches of the iterator ``batches``
        (``(images, labels, num_skipped)`` on the device, as the trainer's loader gives them) at
        learning rate ``lr``, mixing them when ``mixing``; ``meter`` (a Meter, or None) takes each
        micro-batch's loss and logits and counts the step.

        Every process runs the pass, even on a micro-batch whose images were all corrupt: its
        peers wait for its gradients. Returns ``[(out, n)]`` per micro-batch: the detached
        ``(loss, logits)`` (None for an empty micro-batch) and its number of labels."""
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        guard = self._guard()
        if guard is not None:
            guard.save()
        outs, scale = [], 1.0 / self.accum_steps
        for micro in range(self.accum_steps):
            images, labels, num_skipped = next(batches)
            tokens = self.count_tokens(images) if self.count_tokens is not None else 0
            targets = labels
            if mixing and labels.numel():
                images, targets = self.mixer(images, labels)
            last = micro == self.accum_steps - 1
            loss_fn = self.loss_fn
            if self.teacher is not None:  # the teacher sees what the student sees
                loss_fn = loss_fn.bind(self.teacher(images) if labels.numel() else None)
            self.watchdog.arrive("forward and backward")
            out = self.engine.forward_backward(
                images, targets, loss_fn, self.scaler, scale, sync=last
            )
            if meter is not None:
                meter.add_skipped(num_skipped) if out is None else meter.update(
                    *out, labels, num_skipped, tokens=tokens
                )
            outs.append((out, labels.numel()))
        skipped = self.scaler.skipped_steps
        self.engine.step(self.optimizer, self.scaler, self.clip_grad)
        if guard is not None and self.scaler.skipped_steps > skipped:
            guard.restore()  # the skipped step's forward passes updated them
        if meter is not None:
            meter.end_step()
        if self.ema is not None:
            self._update_ema()
        self.watchdog.step_done()
        return outs

    def _update_ema(self):
        """The EMA averages the weights to evaluate (Schedule-Free's average x, not the point y
        its gradients are taken at), switched to only at the steps where it averages."""
        due = self.ema.pending_weight() is not None
        with evaluation_weights(self.optimizer) if due else contextlib.nullcontext():
            self.ema.update(self.engine.module)
