"""Exponential moving average (EMA) of a model's weights.

The average lives beside the model as fp32 tensors (whatever the AMP level), one per parameter and
floating-point buffer, updated with foreach ``lerp_`` launches. Evaluation swaps the average into
the model in place and back (``swapped_into``), so the same code evaluates it under every parallel
engine: with FSDP the averaged tensors are shards like the parameters they follow.
"""

import contextlib

import torch

from pycls.models.blocks import named_saved_buffers


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

    def current_decay(self):
        t = self.num_updates
        decay = min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay
        return decay**self.period

    @torch.no_grad()
    def update(self, model):
        """Call once per optimizer step; averages every ``period``-th call."""
        self.step_count += 1
        if self.step_count % self.period:
            return
        weights = [t.detach().float() for t in _tensors(model, self.names)]
        torch._foreach_lerp_(self.tensors, weights, 1.0 - self.current_decay())
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
            t.copy_(src)
        self.num_updates = state["num_updates"]
        self.step_count = state["step_count"]
