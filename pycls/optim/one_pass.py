"""AdamW as one compiled pass over the flat buffers (OPTIM.ONE_PASS).

``OnePassAdamW`` keeps the contiguous mode's storage (``pycls.optim.flat_buffers``), but one
buffer per (device, dtype) holds the parameters of every group, each group a segment of it, and
its step is ONE call of one function that inductor compiles (``torch.compile``, on every device:
the CPU runs the code a GPU runs). In that pass each element is read once and written once:

- AdamW's update (torch.optim.AdamW's arithmetic: decoupled decay, bias-corrected moments), in
  fp32 whatever the storage dtype, each element with its group's learning rate and weight decay
  (layer decay: one segment per group, found from the element's index, no per-element table);
- under O2 the fp32 master weight, written back rounded into the half-precision weight the model
  uses (what ``master_weights=True`` does in three passes elsewhere: gradient to fp32, update,
  copy back);
- the EMA of the weights (``pycls.core.ema.ModelEMA``, when ``attach_ema`` gave it and an average
  falls due at this step), moved towards the weights as the model will hold them;
- the gradients set to zero, so that the next ``zero_grad`` has nothing to do.

The step counts, learning rates, bias corrections and the EMA's weight reach the pass as one small
tensor copied to the device without waiting (no host sync), so a new learning rate every step
compiles nothing new: one graph per bucket layout (and one more where the EMA averages only every
few steps). A gradient left at None counts as zero, as in the contiguous mode.

Gradient clipping and float16 loss scaling act on the gradients before the step (unscale, clip,
then the pass), so they compose unchanged. AMSGrad and ``maximize`` are not offered.
"""

import math

import torch

from pycls.optim.flat_buffers import Bucket, FlatBuffer
from pycls.optim.optimizers import AdamW

__all__ = ["OnePassAdamW"]

# Graphs the pass may need in one process (bucket layouts x EMA due or not x image sizes of a
# curriculum): past dynamo's default limit of 8 a fullgraph compile fails loudly
_RECOMPILE_LIMIT = 64


def _segment_of(index, bounds):
    """For each element index, the number of segment boundaries at or below it: the segment
    (group) it belongs to. Pointwise comparisons, so inductor fuses them into the update."""
    segment = torch.zeros_like(index)
    for bound in bounds.unbind():
        segment = segment + (index >= bound).to(index.dtype)
    return segment


def adamw_pass(buckets, scalars, beta1, beta2, eps):
    """One AdamW step over flat buffers, in place (the function ``torch.compile`` compiles).

    ``buckets``: tuples ``(weights, grads, exp_avg, exp_avg_sq, master, ema, bounds)``, one per
    flat buffer; ``master`` and ``ema`` may be None; ``bounds`` (int32) holds where each group's
    segment after the first starts. ``scalars`` (fp32, on the device) holds for each bucket in
    turn ``1 - lr * wd`` per segment, ``lr / (1 - beta1^t)`` per segment and
    ``sqrt(1 - beta2^t)``, and at its end the EMA's weight when any bucket averages."""
    at = 0
    for weights, grads, exp_avg, exp_avg_sq, master, ema, bounds in buckets:
        k = bounds.numel() + 1
        decay, step_size = scalars[at : at + k], scalars[at + k : at + 2 * k]
        bc2_sqrt = scalars[at + 2 * k]
        at += 2 * k + 1
        if k > 1:
            index = torch.arange(weights.numel(), device=weights.device, dtype=torch.int32)
            segment = _segment_of(index, bounds)
            decay, step_size = decay[segment], step_size[segment]
        target = weights if master is None else master
        g = grads.float()
        m = torch.lerp(exp_avg.float(), g, 1 - beta1)
        v = exp_avg_sq.float() * beta2 + g * g * (1 - beta2)
        w = target.float() * decay - step_size * m / (v.sqrt() / bc2_sqrt + eps)
        target.copy_(w)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        if master is not None:
            weights.copy_(w)
        if ema is not None:  # towards the weights as the model holds them (rounded under O2)
            ema.lerp_(_as_stored(w, weights.dtype), scalars[-1])
        grads.zero_()


def _as_stored(x, dtype):
    """fp32 ``x`` as a tensor of ``dtype`` holds it, back in fp32. Inductor may keep a value in
    fp32 across a cast to half and back (some versions whatever ``emulate_precision_casts``
    says), so bfloat16's round-to-nearest-even is written out on the bits: add 0x7FFF plus the
    lowest bit kept, clear the low 16 bits."""
    if dtype == torch.float32:
        return x
    if dtype != torch.bfloat16:
        return x.to(dtype).float()
    bits = x.view(torch.int32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # -65536: 0xFFFF0000 as an int32
    return bits.view(torch.float32)


_COMPILED = []


def compiled_pass():
    """``adamw_pass`` compiled once per process (inductor, one graph per bucket layout)."""
    if not _COMPILED:
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), _RECOMPILE_LIMIT))
        # inductor keeps values in fp32 between operations unless asked to round where the code
        # casts: the EMA must average the half weights the model holds, not the fp32 update
        options = {"emulate_precision_casts": True}
        _COMPILED.append(torch.compile(adamw_pass, dynamic=False, fullgraph=True, options=options))
    return _COMPILED[0]


class OnePassAdamW(AdamW):
    """AdamW whose step is one compiled pass over flat buffers (module docstring).

    The same state dict as ``AdamW`` (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``, plus
    ``master`` under ``master_weights``), so checkpoints move between the two. Every group must
    share ``betas`` and ``eps``; ``lr`` and ``weight_decay`` may differ per group (set them in
    ``param_groups`` between steps as usual). All parameters must live on one device.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        master_weights=False,
    ):
        self._ema = None  # (ModelEMA, module) once attach_ema is called
        self._zeroed_at = {}  # bucket index -> its gradient buffer's version after the pass
        super().__init__(
            params, lr, betas, eps, weight_decay, contiguous=True, master_weights=master_weights
        )
        self._flatten_all()

    # -- buffers ---------------------------------------------------------------------------- #
    def _flatten_group(self, group):
        """Nothing per group: ``_flatten_all`` puts every group in one buffer per dtype."""

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self._ready:
            self._flatten_all()

    def rebuild_contiguous(self):
        super().rebuild_contiguous()
        self._flatten_all()

    def _check_groups(self):
        first = self.param_groups[0]
        for group in self.param_groups:
            if tuple(group["betas"]) != tuple(first["betas"]) or group["eps"] != first["eps"]:
                raise ValueError(
                    "OnePassAdamW: every parameter group must share betas and eps (one compiled "
                    f"pass), got {group['betas']}, {group['eps']} beside {first['betas']}, "
                    f"{first['eps']}"
                )
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("OnePassAdamW: amsgrad and maximize are not offered")

    def _flatten_all(self):
        """One bucket per (device, dtype) over every group, each group a segment."""
        self._check_groups()
        by_key = {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad:  # a frozen parameter is never stepped, as in torch.optim
                    by_key.setdefault((p.device, p.dtype), []).append((index, p))
        if len({device for device, _ in by_key}) > 1:
            raise ValueError("OnePassAdamW: all parameters must be on one device")
        self._buckets, self._zeroed_at = [], {}
        keys = self._state_keys(self.param_groups[0])
        for items in by_key.values():
            params = [p for _, p in items]
            bucket = Bucket(
                None, params, keys, self._state_dtype(params[0]), self._has_master(params[0])
            )
            bucket.adopt_state(self.state)
            bucket.segments = _segments(items)
            bucket.bounds = torch.tensor(
                [start for _, start, _ in bucket.segments[1:]],
                dtype=torch.int32,
                device=params[0].device,
            )
            bucket.ema = None  # a view of the EMA's copies once attach_ema is called
            self._share_step(bucket)
            self._buckets.append(bucket)
        self._attach_ema_buffers()

    def _share_step(self, bucket):
        """One 0-d step count for the whole bucket (its parameters step together), which every
        parameter's state refers to: one increment per step, and state dicts stay per
        parameter."""
        shared = self.state[bucket.params[0]]["step"]
        for p in bucket.params:
            self.state[p]["step"] = shared
        bucket.step = shared

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for bucket in self._buckets:
            self._share_step(bucket)

    # -- the EMA ------------------------------------------------------------------------------ #
    def attach_ema(self, ema, module):
        """Averages ``ema``'s copies of the parameters this optimizer steps inside its pass
        (``module``: the model whose parameters ``ema`` names). Those copies become views of
        one fp32 buffer per bucket; ``ema.update`` keeps averaging the rest."""
        self._ema = (ema, module)
        self._attach_ema_buffers()

    def _attach_ema_buffers(self):
        if self._ema is None:
            return
        ema, module = self._ema
        position = {name: i for i, name in enumerate(ema.names)}
        index_of = {p: position[n] for n, p in module.named_parameters() if n in position}
        handed = []
        for bucket in self._buckets:
            bucket.ema = FlatBuffer(bucket.params, torch.float32, bucket.params[0].device)
            for p, view in zip(bucket.params, bucket.ema.views):
                i = index_of[p]
                view.copy_(ema.tensors[i])
                ema.tensors[i] = view
                handed.append(i)
        ema.hand_over(handed)

    # -- gradients ------------------------------------------------------------------------------ #
    def zero_grad(self, set_to_none=True):
        """As the contiguous mode's (buffers zeroed in place), but a buffer that nothing wrote
        since the pass zeroed it is left alone."""
        for index, bucket in enumerate(self._buckets):
            bucket.sync_views()
            flat = bucket.grads.flat
            if self._zeroed_at.get(index) != flat._version:
                flat.zero_()

    # -- step --------------------------------------------------------------------------------- #
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._buckets:
            return loss
        ema_weight = self._ema[0].pending_weight() if self._ema is not None else None
        host, work = [], []
        for bucket in self._buckets:
            bucket.sync_views()
            host += self._bucket_scalars(bucket)
            ema = bucket.ema.flat if ema_weight is not None else None
            master = bucket.master.flat if bucket.master is not None else None
            state = [bucket.state[k].flat for k in ("exp_avg", "exp_avg_sq")]
            work.append((bucket.data.flat, bucket.grads.flat, *state, master, ema, bucket.bounds))
        if ema_weight is not None:
            host.append(ema_weight)
        device = self._buckets[0].data.flat.device
        scalars = torch.tensor(host, dtype=torch.float32).to(device, non_blocking=True)
        beta1, beta2 = self.param_groups[0]["betas"]
        compiled_pass()(work, scalars, beta1, beta2, self.param_groups[0]["eps"])
        for index, bucket in enumerate(self._buckets):
            self._zeroed_at[index] = bucket.grads.flat._version
        if ema_weight is not None:
            self._ema[0].averaged_elsewhere()
        return loss

    def _bucket_scalars(self, bucket):
        """The bucket's share of the pass's scalars, its step count advanced (host numbers)."""
        t = int(bucket.step)
        if bucket.master is not None and t == 0:
            bucket.master.flat.copy_(bucket.data.flat)  # weights may have been loaded since
        t += 1
        bucket.step.fill_(t)
        beta1, beta2 = self.param_groups[0]["betas"]
        groups = [self.param_groups[index] for index, _, _ in bucket.segments]
        decay = [1.0 - g["lr"] * g["weight_decay"] for g in groups]
        step_size = [g["lr"] / (1.0 - beta1**t) for g in groups]
        return decay + step_size + [math.sqrt(1.0 - beta2**t)]


def _segments(items):
    """``[(group index, start, end)]`` of consecutive parameters of one group, in elements."""
    segments, offset = [], 0
    for index, p in items:
        if segments and segments[-1][0] == index:
            segments[-1] = (index, segments[-1][1], offset + p.numel())
        else:
            segments.append((index, offset, offset + p.numel()))
        offset += p.numel()
    return segments
