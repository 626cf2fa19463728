"""Multi-tensor optimizers (SGD, AdamW, LAMB) and the parameter groups they train.

Each ``step`` issues one ``torch._foreach_*`` launch per operation for all tensors of a dtype and
device, instead of one per parameter. Two options go further:

- ``contiguous=True``: the parameters and gradients of each (group, device, dtype) become views into
  one flat buffer, so each operation of the update is a single large kernel over that buffer.
- ``master_weights=True`` (AMP level O2): parameters live in half precision, the optimizer keeps an
  fp32 copy of each, updates the copy with fp32 math and writes it back rounded.

State dicts have torch.optim's per-parameter layout (``step``, ``momentum_buffer``, ``exp_avg``,
``exp_avg_sq``, plus ``master`` under O2), so checkpoints move between modes.
"""

import math

import torch
from torch import nn

__all__ = ["SGD", "AdamW", "LAMB", "param_groups", "construct_optimizer"]


def _group_by_device_dtype(params):
    """{(device, dtype): [params]} for the parameters of one group that have a gradient."""
    buckets = {}
    for p in params:
        if p.grad is not None:
            buckets.setdefault((p.device, p.dtype), []).append(p)
    return buckets


class _FlatBuffer:
    """One flat tensor holding several same-dtype tensors as views (parameters or gradients)."""

    def __init__(self, tensors, dtype=None):
        dtype = dtype or tensors[0].dtype
        total = sum(t.numel() for t in tensors)
        self.flat = torch.zeros(total, dtype=dtype, device=tensors[0].device)
        self.views, offset = [], 0
        for t in tensors:
            n = t.numel()
            self.views.append(self.flat[offset : offset + n].view_as(t))
            offset += n

    def holds(self, tensor, index):
        return tensor is not None and tensor.data_ptr() == self.views[index].data_ptr()


class _MultiTensorOptimizer(torch.optim.Optimizer):
    """Shared machinery: bucketing, contiguous buffers, master weights, state-dict handling.

    Subclasses implement ``_init_state(p, state)`` and ``_update(group, params, grads, states)``
    where the lists hold same-dtype tensors that are either per-parameter tensors or, in
    contiguous mode, one flat tensor per bucket (LAMB also gets the per-parameter views).
    """

    _state_keys = ()

    def __init__(self, params, defaults, *, contiguous=False, master_weights=False):
        super().__init__(params, defaults)
        self.contiguous = contiguous
        self.master_weights = master_weights
        self._buckets = None
        if master_weights:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["master"] = p.detach().clone().float()
        if contiguous:
            self._make_contiguous()

    # -- contiguous buffers ----------------------------------------------------------------- #
    def _make_contiguous(self):
        """Rebinds params, grads and state of each (group, device, dtype) onto flat buffers."""
        self._buckets = []
        for group in self.param_groups:
            by_key = {}
            for p in group["params"]:
                by_key.setdefault((p.device, p.dtype), []).append(p)
            for params in by_key.values():
                self._buckets.append(self._flatten_bucket(group, params))

    def _flatten_bucket(self, group, params):
        data = _FlatBuffer(params)
        grads = _FlatBuffer(params)
        for p, view in zip(params, data.views):
            view.copy_(p.detach())
            p.data = view
        for p, view in zip(params, grads.views):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
        bucket = {"group": group, "params": params, "data": data, "grads": grads, "state": {}}
        state_dtype = torch.float32 if self.master_weights else params[0].dtype
        for key in self._state_keys + (("master",) if self.master_weights else ()):
            buf = _FlatBuffer(params, dtype=state_dtype)
            for p, view in zip(params, buf.views):
                if key in self.state[p]:
                    view.copy_(self.state[p][key])
                elif key == "master":
                    view.copy_(p.detach())
                self.state[p][key] = view
            bucket["state"][key] = buf
        for p in params:
            self.state[p].setdefault("step", torch.tensor(0.0))
        return bucket

    def _sync_flat_grads(self, bucket):
        """Gradients must be views of the flat buffer; copy any that something replaced."""
        for i, p in enumerate(bucket["params"]):
            if not bucket["grads"].holds(p.grad, i):
                view = bucket["grads"].views[i]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def zero_grad(self, set_to_none=True):
        if not self.contiguous:
            return super().zero_grad(set_to_none=set_to_none)
        for bucket in self._buckets:  # one memset per buffer; the views must survive
            bucket["grads"].flat.zero_()
            self._sync_flat_grads(bucket)

    # -- state dicts ------------------------------------------------------------------------ #
    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.master_weights:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("master", p.detach().clone().float())
        if self.contiguous:
            for bucket in self._buckets:  # loaded tensors are fresh; copy them into the buffers
                for key, buf in bucket["state"].items():
                    for p, view in zip(bucket["params"], buf.views):
                        if key in self.state[p] and self.state[p][key] is not view:
                            view.copy_(self.state[p][key])
                        self.state[p][key] = view

    # -- step ------------------------------------------------------------------------------- #
    def _ensure_state(self, p):
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            self._init_state(p, state)
        return state

    def _init_state(self, p, state):
        ref = state["master"] if self.master_weights else p
        for key in self._state_keys:
            state[key] = torch.zeros_like(ref, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.contiguous:
            for bucket in self._buckets:
                self._sync_flat_grads(bucket)
                self._step_bucket(bucket)
        else:
            for group in self.param_groups:
                for params in _group_by_device_dtype(group["params"]).values():
                    self._step_params(group, params)
        return loss

    def _step_params(self, group, params):
        states = [self._ensure_state(p) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        grads = [p.grad for p in params]
        if self.master_weights:
            targets = [s["master"] for s in states]
            grads = [g.float() for g in grads]
        else:
            targets = params
        buffers = {k: [s[k] for s in states] for k in self._state_keys}
        self._update(group, targets, grads, buffers, [float(s) for s in steps], targets)
        if self.master_weights:
            torch._foreach_copy_(params, targets)

    def _step_bucket(self, bucket):
        params, group = bucket["params"], bucket["group"]
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1.0)
        step = float(steps[0])  # a bucket's parameters are always stepped together
        grad = bucket["grads"].flat
        if self.master_weights:
            target, grad = bucket["state"]["master"], grad.float()
            per_param = bucket["state"]["master"].views
        else:
            target, per_param = bucket["data"], bucket["data"].views
        buffers = {k: [bucket["state"][k].flat] for k in self._state_keys}
        self._update(group, [target.flat], [grad], buffers, [step], per_param, bucket)
        if self.master_weights:
            bucket["data"].flat.copy_(target.flat)

    def _update(self, group, params, grads, buffers, steps, per_param, bucket=None):
        raise NotImplementedError


class SGD(_MultiTensorOptimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD's update)."""

    _state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        *,
        contiguous=False,
        master_weights=False,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: invalid lr={lr}, momentum={momentum} or wd={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults, contiguous=contiguous, master_weights=master_weights)

    def _update(self, group, params, grads, buffers, steps, per_param, bucket=None):
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        if wd != 0:
            grads = torch._foreach_add(grads, params, alpha=wd)
        if momentum != 0:
            bufs = buffers["momentum_buffer"]
            fresh = [i for i, s in enumerate(steps) if s == 1]
            for i in fresh:  # torch.optim starts the buffer at the first gradient
                bufs[i].copy_(grads[i])
            rest = [i for i in range(len(bufs)) if i not in fresh]
            if rest:
                torch._foreach_mul_([bufs[i] for i in rest], momentum)
                torch._foreach_add_(
                    [bufs[i] for i in rest],
                    [grads[i] for i in rest],
                    alpha=1 - group["dampening"],
                )
            if group["nesterov"]:
                grads = torch._foreach_add(grads, bufs, alpha=momentum)
            else:
                grads = bufs
        torch._foreach_add_(params, grads, alpha=-lr)


class AdamW(_MultiTensorOptimizer):
    """Adam with decoupled weight decay (torch.optim.AdamW's update), optional AMSGrad."""

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        contiguous=False,
        master_weights=False,
    ):
        _check_adam_args("AdamW", lr, betas, eps, weight_decay)
        if amsgrad:
            self._state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        defaults["amsgrad"] = amsgrad
        super().__init__(params, defaults, contiguous=contiguous, master_weights=master_weights)

    def _update(self, group, params, grads, buffers, steps, per_param, bucket=None):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        exp_avg, exp_avg_sq = buffers["exp_avg"], buffers["exp_avg_sq"]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        if group["amsgrad"]:
            torch._foreach_maximum_(buffers["max_exp_avg_sq"], exp_avg_sq)
            exp_avg_sq = buffers["max_exp_avg_sq"]
        step_sizes = [-lr / (1 - beta1**s) for s in steps]
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**s) for s in steps])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, step_sizes)


class LAMB(_MultiTensorOptimizer):
    """LAMB (You et al., 2019, "Large batch optimization for deep learning").

    Adam moments with bias correction; the update u = m̂ / (sqrt(v̂) + eps) + wd * w is scaled per
    parameter tensor by the trust ratio ||w|| / ||u|| (1 where either norm is 0). As in common
    implementations, tensors without weight decay (norms, biases) take the plain Adam step unless
    ``always_adapt``. No gradient clipping inside: use OPTIM.CLIP_GRAD.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        always_adapt=False,
        *,
        contiguous=False,
        master_weights=False,
    ):
        _check_adam_args("LAMB", lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        defaults["always_adapt"] = always_adapt
        super().__init__(params, defaults, contiguous=contiguous, master_weights=master_weights)

    def _update(self, group, params, grads, buffers, steps, per_param, bucket=None):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = buffers["exp_avg"], buffers["exp_avg_sq"]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**s) for s in steps])
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(exp_avg, denom)
        torch._foreach_div_(update, [1 - beta1**s for s in steps])
        if wd != 0:
            torch._foreach_add_(update, params, alpha=wd)
        if wd != 0 or group["always_adapt"]:
            # The trust ratio is per parameter tensor: in contiguous mode, take norms of the views
            if bucket is not None:
                update_views = _views_like(update[0], per_param)
                ratio = _trust_ratios(per_param, update_views)
                torch._foreach_mul_(update_views, ratio)
            else:
                torch._foreach_mul_(update, _trust_ratios(params, update))
        torch._foreach_add_(params, update, alpha=-lr)


def _views_like(flat, like):
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def _trust_ratios(params, updates):
    """||w|| / ||u|| per tensor, 1 where either is 0; computed on the device without a sync."""
    w_norm = torch.stack(torch._foreach_norm(params))
    u_norm = torch.stack(torch._foreach_norm(updates))
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    return list(ratio.unbind())


def _check_adam_args(name, lr, betas, eps, weight_decay):
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"{name}: invalid lr={lr}, eps={eps} or weight_decay={weight_decay}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: betas must be two values in [0, 1), got {betas}")


# ------------------------------------------------------------------------------------------------ #
# Parameter groups and construction from the config
# ------------------------------------------------------------------------------------------------ #

_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def no_weight_decay_names(model):
    """Names of parameters that take no weight decay: norms, biases, embeddings and tokens.

    A model may declare its own through ``no_weight_decay_names()``; otherwise every parameter of
    a normalisation layer and every 1-d parameter (biases, scales) is excluded.
    """
    if hasattr(model, "no_weight_decay_names"):
        return set(model.no_weight_decay_names())
    names = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if isinstance(module, _NORM_TYPES) or p.ndim <= 1:
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def param_groups(model, weight_decay, no_decay_weight_decay=0.0):
    """Two groups: weights with ``weight_decay``, the no-decay set with ``no_decay_weight_decay``."""
    skip = no_weight_decay_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": no_decay_weight_decay, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def construct_optimizer(cfg, model, master_weights=False):
    """The optimizer OPTIM describes, over weight-decay groups built from the model."""
    o = cfg.OPTIM
    groups = param_groups(model, o.WEIGHT_DECAY, o.WEIGHT_DECAY_NO_DECAY_GROUP)
    common = dict(contiguous=o.CONTIGUOUS_PARAMS, master_weights=master_weights)
    if o.OPTIMIZER == "sgd":
        return SGD(
            groups,
            lr=o.BASE_LR,
            momentum=o.MOMENTUM,
            dampening=o.DAMPENING,
            nesterov=o.NESTEROV,
            weight_decay=o.WEIGHT_DECAY,
            **common,
        )
    if o.OPTIMIZER == "adamw":
        betas = tuple(o.BETAS)
        return AdamW(groups, lr=o.BASE_LR, betas=betas, eps=o.EPS, **common)
    return LAMB(groups, lr=o.BASE_LR, betas=tuple(o.BETAS), eps=o.EPS, **common)
