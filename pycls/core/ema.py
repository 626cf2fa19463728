"""Exponential moving average (EMA) of a model's weights.

The average lives beside the model as fp32 tensors (whatever the AMP level), one per parameter and
floating-point buffer, updated with foreach ``lerp_`` launches. Evaluation swaps the average into
the model in place and back (``swapped_into``), so the same code evaluates it under every parallel
engine: with FSDP the averaged tensors are shards like the parameters they follow.

An optimizer that already reads and writes the weights in one pass over flat buffers
(``pycls.optim.one_pass``) can take the average of the parameters it steps into that pass: it
asks ``pending_weight()`` before its step, averages the tensors ``hand_over`` gave it and says so
with ``averaged_elsewhere()``; ``update`` then averages only the rest (buffers, frozen
parameters), or everything when the optimizer did not step (a skipped float16 step).
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pycls.models.groups import named_saved_buffers


def _averaged_names(model):
    """Parameters, then the floating-point buffers a checkpoint holds (norm statistics), in a
    fixed order. Not the non-persistent buffers (the drop-path rates): settings, not weights,
    which an average swapped into the model would set back to an old value."""
    names = [n for n, _ in model.named_parameters()]
    return names + [n for n, b in named_saved_buffers(model) if b.is_floating_point()]


def _tensors(model, names):
    """The model's parameters and buffers of these ``names``, in order."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    return [named[n] for n in names]


class ModelEMA:
    """ema <- decay * ema + (1 - decay) * weights, every ``period`` optimizer steps.

    With ``warmup`` the decay at update t is min(decay, (1 + t) / (10 + t)), so the average is not
    dominated by the random initial weights. Updating every ``period`` steps uses decay^period,
    which keeps the averaging horizon in steps unchanged.
    """

    def __init__(self, model, decay=0.9998, warmup=True, period=1):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay, self.warmup, self.period = decay, warmup, period
        self.names = _averaged_names(model)
        self.tensors = [t.detach().clone().float() for t in _tensors(model, self.names)]
        self.num_updates = 0
        self.step_count = 0
        self._elsewhere = frozenset()  # indices of the tensors another pass averages
        self._averaged_elsewhere = False

    def current_decay(self):
        t = self.num_updates
        decay = min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay
        return decay**self.period

    def hand_over(self, indices):
        """The tensors at these indices (of ``names``) are averaged by another pass from now on,
        when it calls ``averaged_elsewhere``."""
        self._elsewhere = frozenset(indices)

    def pending_weight(self):
        """The interpolation weight (1 - decay) of the next ``update`` if it averages, else
        None."""
        if (self.step_count + 1) % self.period:
            return None
        return 1.0 - self.current_decay()

    def averaged_elsewhere(self):
        """The handed-over tensors were averaged at ``pending_weight()`` towards the weights
        of this step: the next ``update`` leaves them alone."""
        self._averaged_elsewhere = True

    @torch.no_grad()
    def update(self, model):
        """Call once per optimizer step; averages every ``period``-th call."""
        self.step_count += 1
        skip = self._elsewhere if self._averaged_elsewhere else ()
        self._averaged_elsewhere = False
        if self.step_count % self.period:
            return
        tensors = _tensors(model, self.names)
        own = [i for i in range(len(tensors)) if i not in skip]
        if own:
            weights = [tensors[i].detach().float() for i in own]
            torch._foreach_lerp_(
                [self.tensors[i] for i in own], weights, 1.0 - self.current_decay()
            )
        self.num_updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_into(self, model):
        """Within the block, the model holds the averaged weights; its own come back after."""
        targets = _tensors(model, self.names)
        saved = [t.detach().clone() for t in targets]
        for target, avg in zip(targets, self.tensors):
            target.copy_(avg)
        try:
            yield model
        finally:
            for target, own in zip(targets, saved):
                target.copy_(own)

    def state_dict(self):
        return {
            "num_updates": self.num_updates,
            "step_count": self.step_count,
            "tensors": dict(zip(self.names, self.tensors)),
        }

    def load_state_dict(self, state):
        missing = set(self.names) - set(state["tensors"])
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:5]}")
        for name, t in zip(self.names, self.tensors):
            src = state["tensors"][name]
            if src.shape != t.shape:  # e.g. a position embedding at another curriculum size
                raise ValueError(
                    f"EMA tensor {name} has shape {tuple(src.shape)}, the model {tuple(t.shape)}"
                )
            if isinstance(t, DTensor) and not isinstance(src, DTensor):
                # a single file's full tensor into a shard (FSDP2, HSDP, the device mesh): this
                # process's part of it, cut as the parameter is
                src = distribute_tensor(
                    src.to(t.device, t.dtype), t.device_mesh, t.placements, src_data_rank=None
                )
            t.copy_(src)
        self.num_updates = state["num_updates"]
        self.step_count = state["step_count"]
