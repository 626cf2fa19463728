"""Multi-tensor optimizers (SGD, AdamW, LAMB) and the parameter groups they train.

Each ``step`` issues one ``torch._foreach_*`` call per operation for all tensors of a dtype and
device, instead of one per parameter. Two options go further, and float16 gets special care:

- ``contiguous=True``: the parameters and gradients of each (group, device, dtype) become views into
  one flat buffer, so each operation of the update is a single large kernel over that buffer. Build
  the optimizer after the model is on its device and cast (``model.to()`` afterwards would replace
  the views; a parameter whose shape changes needs ``rebuild_contiguous()``). In this mode every
  parameter of a bucket is stepped together: a gradient left at ``None`` counts as zero (weight
  decay and momentum still apply), and ``zero_grad()`` zeroes the buffer in place whatever
  ``set_to_none`` says, so the views survive.
- ``master_weights=True`` (AMP level O2): half-precision parameters get an fp32 copy in the
  optimizer state (``master``); the update runs in fp32 on the copy and is written back rounded.
  Moments of those parameters are fp32 too. fp32 parameters (the norms under O2) need no copy.
- float16 parameters without master weights (AMP level O3) still keep fp32 moments and are updated
  through a temporary fp32 copy: in float16, ``v = g^2`` is 0 for ``|g| < 2.4e-4`` and ``eps =
  1e-8`` rounds to 0, so Adam would divide by zero. bfloat16 has fp32's range and stays bfloat16.

State dicts have torch.optim's per-parameter layout (``step``, ``momentum_buffer``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``, plus ``master`` under O2), so checkpoints move between modes and
from torch.optim into these classes.
"""

import math

import torch

from pycls.models.groups import layer_id, lr_scale, no_weight_decay_names

__all__ = [
    "SGD",
    "AdamW",
    "LAMB",
    "param_groups",
    "construct_optimizer",
    "no_weight_decay_names",
]

_HALF = (torch.float16, torch.bfloat16)


class _FlatBuffer:
    """One flat tensor holding same-shaped views of several tensors, in order."""

    def __init__(self, like, dtype, device):
        self.flat = torch.zeros(sum(t.numel() for t in like), dtype=dtype, device=device)
        self.views = _views_like(self.flat, like)

    def holds(self, i, tensor):
        """Whether ``tensor`` is (still) the i-th view of this buffer."""
        view = self.views[i]
        return (
            tensor is not None
            and tensor.data_ptr() == view.data_ptr()
            and tensor.shape == view.shape
            and tensor.dtype == view.dtype
        )


def _views_like(flat, like):
    """Views of consecutive slices of ``flat`` shaped like the tensors of ``like``."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


class _Bucket:
    """The parameters of one (group, device, dtype) with their data, grads and state flattened."""

    def __init__(self, group_index, params, state_keys, state_dtype, with_master):
        # The group by index: load_state_dict replaces the group dicts with new ones
        self.group_index, self.params, self.state_dtype = group_index, params, state_dtype
        device, dtype = params[0].device, params[0].dtype
        self.data = _FlatBuffer(params, dtype, device)
        self.grads = _FlatBuffer(params, dtype, device)
        for p, view in zip(params, self.data.views):
            view.copy_(p.detach())
            p.data = view
        for p, view in zip(params, self.grads.views):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
        keys = state_keys + (("master",) if with_master else ())
        self.state = {key: _FlatBuffer(params, state_dtype, device) for key in keys}

    @property
    def master(self):
        return self.state.get("master")

    def adopt_state(self, state):
        """Copies per-parameter state tensors into the flat buffers and rebinds them as views.

        A missing moment starts at zero and a missing master at the parameter's value. All
        parameters of a bucket share one step count (the largest loaded one), because the update
        runs on the whole buffer at once.
        """
        for key, buf in self.state.items():
            for p, view in zip(self.params, buf.views):
                value = state[p].get(key)
                if value is None and key == "master":
                    view.copy_(p.detach())
                elif value is None:
                    view.zero_()
                elif value is not view:
                    view.copy_(value)
                state[p][key] = view
        step = max((float(state[p]["step"]) for p in self.params if "step" in state[p]), default=0)
        for p in self.params:
            state[p]["step"] = torch.tensor(float(step))

    def sync_views(self):
        """Rebinds parameters and gradients that something replaced back onto the buffers."""
        for i, p in enumerate(self.params):
            if not self.data.holds(i, p):
                if p.shape != self.data.views[i].shape:
                    raise RuntimeError(
                        f"a parameter of shape {tuple(self.data.views[i].shape)} became "
                        f"{tuple(p.shape)} after the contiguous optimizer was built; call "
                        "rebuild_contiguous() after changing parameter shapes"
                    )
                self.data.views[i].copy_(p.detach())
                p.data = self.data.views[i]
            if not self.grads.holds(i, p.grad):
                view = self.grads.views[i]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view


class _MultiTensorOptimizer(torch.optim.Optimizer):
    """Shared machinery: bucketing, contiguous buffers, master weights, state-dict handling.

    Subclasses define ``_state_keys(group)`` (the per-parameter buffers, all starting at zero) and
    ``_update(group, params, grads, buffers, steps, segments)``: ``params``, ``grads`` and each
    list in ``buffers`` hold same-dtype tensors (fp32 targets under master weights), one per
    parameter or, in contiguous mode, one flat tensor per bucket, with ``segments`` the
    per-parameter views of that flat tensor (for per-tensor quantities such as LAMB's trust ratio).
    """

    def __init__(self, params, defaults, *, contiguous=False, master_weights=False):
        self.contiguous, self.master_weights = contiguous, master_weights
        self._buckets = []
        self._ready = False
        super().__init__(params, defaults)
        self._ready = True
        for group in self.param_groups:
            self._prepare_group(group)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self._ready:  # groups added later get their master copies and buffers too
            self._prepare_group(self.param_groups[-1])

    def _state_keys(self, group):
        return ()

    def _has_master(self, p):
        return self.master_weights and p.dtype in _HALF

    def _state_dtype(self, p):
        """fp32 for master weights, and for float16 parameters (whose Adam moments underflow)."""
        return torch.float32 if self._has_master(p) or p.dtype == torch.float16 else p.dtype

    def _prepare_group(self, group):
        for p in group["params"]:
            if self._has_master(p) and "master" not in self.state[p]:
                self.state[p]["master"] = p.detach().float()
        if self.contiguous:
            self._flatten_group(group)

    def rebuild_contiguous(self):
        """Builds the flat buffers again after a parameter changed shape (a resampled position
        embedding); parameters, gradients and the state in ``self.state`` are carried over."""
        if not self.contiguous:
            return
        self._buckets = []
        for group in self.param_groups:
            self._prepare_group(group)

    def _flatten_group(self, group):
        by_key = {}
        for p in group["params"]:
            if p.requires_grad:  # a frozen parameter is never stepped, as in torch.optim
                by_key.setdefault((p.device, p.dtype), []).append(p)
        for params in by_key.values():
            bucket = _Bucket(
                next(i for i, g in enumerate(self.param_groups) if g is group),
                params,
                self._state_keys(group),
                self._state_dtype(params[0]),
                self._has_master(params[0]),
            )
            bucket.adopt_state(self.state)
            self._buckets.append(bucket)

    # -- gradients -------------------------------------------------------------------------- #
    def grad_tensors(self):
        """Every gradient as few tensors as possible: the flat buffers in contiguous mode.

        The loss scaler unscales and checks these (one kernel per buffer instead of per tensor).
        """
        if self.contiguous:
            for bucket in self._buckets:
                bucket.sync_views()
            return [bucket.grads.flat for bucket in self._buckets]
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def zero_grad(self, set_to_none=True):
        """As torch.optim's; in contiguous mode the buffers are zeroed in place instead."""
        if not self.contiguous:
            return super().zero_grad(set_to_none=set_to_none)
        for bucket in self._buckets:  # one memset per buffer; the views must survive
            bucket.grads.flat.zero_()
            bucket.sync_views()

    # -- state dicts ------------------------------------------------------------------------ #
    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # torch.optim casts every floating state tensor to its parameter's dtype (which would round
        # fp32 master weights and moments to half) and may alias the caller's tensors: redo it.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            state = self.state[p]
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if value is None:  # torch.optim.SGD without momentum stores None
                    state.pop(key, None)
                elif key == "step":
                    state[key] = torch.tensor(float(value))
                elif torch.is_tensor(value) and value.is_floating_point():
                    state[key] = value.to(p.device, self._state_dtype(p), copy=True)
            if "step" not in state and state:  # torch.optim.SGD keeps no step count
                state["step"] = torch.tensor(1.0)
            if not self._has_master(p):
                state.pop("master", None)
            elif "master" not in state:  # a checkpoint from a run without master weights
                state["master"] = p.detach().float()
        for bucket in self._buckets:
            bucket.adopt_state(self.state)

    # -- step ------------------------------------------------------------------------------- #
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.contiguous:
            for bucket in self._buckets:
                self._step_bucket(bucket)
            return loss
        for group in self.param_groups:
            by_key = {}
            for p in group["params"]:
                if p.grad is not None:  # as torch.optim: no gradient, no step
                    by_key.setdefault((p.device, p.dtype), []).append(p)
            for params in by_key.values():
                self._step_params(group, params)
        return loss

    def _ensure_state(self, group, p):
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        for key in self._state_keys(group):
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=self._state_dtype(p))
        return state

    def _step_params(self, group, params):
        states = [self._ensure_state(group, p) for p in params]
        steps = [s["step"] for s in states]
        with_master = self._has_master(params[0])
        if with_master:
            for p, s, step in zip(params, states, steps):
                if step == 0:  # the weights may have been loaded after this optimizer was built
                    s["master"].copy_(p.detach())
        torch._foreach_add_(steps, 1.0)
        grads, targets = [p.grad for p in params], params
        fp32_math = self._state_dtype(params[0]) != params[0].dtype
        if fp32_math:  # the update runs in fp32 on the master copy or on a temporary one
            grads = [g.float() for g in grads]
            targets = [s["master"] for s in states] if with_master else [p.float() for p in params]
        buffers = {k: [s[k] for s in states] for k in self._state_keys(group)}
        self._update(group, targets, grads, buffers, [float(s) for s in steps], None)
        if fp32_math:
            torch._foreach_copy_(params, targets)

    def _step_bucket(self, bucket):
        bucket.sync_views()
        steps = [self.state[p]["step"] for p in bucket.params]
        if bucket.master is not None and steps[0] == 0:
            bucket.master.flat.copy_(bucket.data.flat)  # weights may have been loaded since
        torch._foreach_add_(steps, 1.0)
        data, grad = bucket.data.flat, bucket.grads.flat
        target, segments = data, bucket.data.views
        if bucket.master is not None:
            target, segments = bucket.master.flat, bucket.master.views
        elif bucket.state_dtype != data.dtype:  # float16 without master: fp32 on a temporary copy
            target = data.float()
            segments = _views_like(target, bucket.params)
        if grad.dtype != target.dtype:
            grad = grad.float()
        group = self.param_groups[bucket.group_index]
        buffers = {k: [bucket.state[k].flat] for k in self._state_keys(group)}
        self._update(group, [target], [grad], buffers, [float(steps[0])], segments)
        if target is not data:
            data.copy_(target)

    def _update(self, group, params, grads, buffers, steps, segments):
        raise NotImplementedError


class SGD(_MultiTensorOptimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay: torch.optim.SGD's update.

    With ``g = grad + wd * w``: ``b = g`` on the first step, then ``b = momentum * b +
    (1 - dampening) * g``; the step is ``w -= lr * (g + momentum * b)`` (Nesterov) or
    ``w -= lr * b``; without momentum, ``w -= lr * g``.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        *,
        maximize=False,
        contiguous=False,
        master_weights=False,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: invalid lr={lr}, momentum={momentum} or wd={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening)
        defaults.update(weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, contiguous=contiguous, master_weights=master_weights)

    def _state_keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _update(self, group, params, grads, buffers, steps, segments):
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        if wd != 0:
            grads = torch._foreach_add(grads, params, alpha=wd)
        if momentum != 0:
            bufs = buffers["momentum_buffer"]
            first = [i for i, s in enumerate(steps) if s == 1]
            for i in first:  # as torch.optim, the buffer starts at the first gradient
                bufs[i].copy_(grads[i])
            rest = [i for i in range(len(bufs)) if steps[i] != 1]
            if rest:
                rest_bufs = [bufs[i] for i in rest]
                torch._foreach_mul_(rest_bufs, momentum)
                torch._foreach_add_(
                    rest_bufs, [grads[i] for i in rest], alpha=1 - group["dampening"]
                )
            if group["nesterov"]:
                grads = torch._foreach_add(grads, bufs, alpha=momentum)
            else:
                grads = bufs
        torch._foreach_add_(params, grads, alpha=-lr)


class AdamW(_MultiTensorOptimizer):
    """Adam with decoupled weight decay (torch.optim.AdamW's update), optional AMSGrad.

    ``w *= 1 - lr * wd``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2`` (AMSGrad uses the
    running maximum of ``v``); ``w -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)``.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        contiguous=False,
        master_weights=False,
    ):
        _check_adam_args("AdamW", lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        defaults.update(amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, contiguous=contiguous, master_weights=master_weights)

    def _state_keys(self, group):
        keys = ("exp_avg", "exp_avg_sq")
        return keys + ("max_exp_avg_sq",) if group["amsgrad"] else keys

    def _update(self, group, params, grads, buffers, steps, segments):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        exp_avg, exp_avg_sq = buffers["exp_avg"], buffers["exp_avg_sq"]
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
        if group["amsgrad"]:
            torch._foreach_maximum_(buffers["max_exp_avg_sq"], exp_avg_sq)
            exp_avg_sq = buffers["max_exp_avg_sq"]
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**s) for s in steps])
        torch._foreach_add_(denom, eps)
        step_sizes = [-lr / (1 - beta1**s) for s in steps]
        torch._foreach_addcdiv_(params, exp_avg, denom, step_sizes)


class LAMB(_MultiTensorOptimizer):
    """LAMB (You et al., 2019, "Large batch optimization for deep learning").

    Adam moments with bias correction, ``m̂ = m / (1 - b1^t)`` and ``v̂ = v / (1 - b2^t)``; the
    update ``u = m̂ / (sqrt(v̂) + eps) + wd * w`` is scaled per parameter tensor by the trust ratio
    ``r = ||w|| / ||u||`` (1 where either norm is 0): ``w -= lr * r * u``. As in common
    implementations, tensors without weight decay (norms, biases) take the plain Adam step
    (``r = 1``) unless ``always_adapt``. No gradient clipping inside: use OPTIM.CLIP_GRAD.
    """

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

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _update(self, group, params, grads, buffers, steps, segments):
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
            # The ratio is per parameter tensor: in contiguous mode, norms of the views
            if segments is not None:
                update_views = _views_like(update[0], segments)
                torch._foreach_mul_(update_views, _trust_ratios(segments, update_views))
            else:
                torch._foreach_mul_(update, _trust_ratios(params, update))
        torch._foreach_add_(params, update, alpha=-lr)


def _trust_ratios(weights, updates):
    """LAMB's ``||w|| / ||u||`` per tensor (1 where either is 0), on the device without a sync."""
    w_norm = torch.stack(torch._foreach_norm(weights))
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


def param_groups(model, weight_decay, no_decay_weight_decay=0.0, *, layer_decay=1.0, depth=0):
    """Parameter groups by weight decay and, with ``layer_decay`` < 1, by layer.

    Without layer decay: two groups, weights with ``weight_decay`` ("decay") and norms, biases,
    embeddings with the other rate ("no_decay"). With it, each of those is split by layer
    (``pycls.models.groups.layer_id`` over ``depth`` blocks) into groups "layer{l}_decay" and
    "layer{l}_no_decay" carrying ``lr_scale = layer_decay ** (depth + 1 - l)``, which
    ``schedules.set_lr`` applies. Parameters that require no gradient (frozen) are left out.
    """

    skip = no_weight_decay_names(model)
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = "no_decay" if name in skip else "decay"
        layer = layer_id(name, depth) if layer_decay != 1.0 else None
        if (layer, kind) not in groups:
            wd = no_decay_weight_decay if kind == "no_decay" else weight_decay
            group = {"params": [], "weight_decay": wd, "name": kind}
            if layer is not None:
                group.update(
                    name=f"layer{layer}_{kind}", lr_scale=lr_scale(layer, depth, layer_decay)
                )
            groups[(layer, kind)] = group
        groups[(layer, kind)]["params"].append(p)
    # A fixed order (by layer, decay before no-decay) so optimizer state dicts line up
    order = sorted(groups, key=lambda k: (-1 if k[0] is None else k[0], k[1] != "decay"))
    return [groups[k] for k in order]


def construct_optimizer(cfg, model, master_weights=False):
    """The optimizer OPTIM describes, over weight-decay groups built from the model.

    Build it after the model is on its device and cast for the AMP level: the contiguous mode
    rebinds the parameters onto its buffers, and master weights copy them.
    """
    o = cfg.OPTIM
    groups = param_groups(
        model,
        o.WEIGHT_DECAY,
        o.WEIGHT_DECAY_NO_DECAY_GROUP,
        layer_decay=o.LAYER_DECAY,
        depth=cfg.VIT.DEPTH,
    )
    for group in groups:  # the schedule sets the rates every iteration; start at the base rate
        group["lr"] = o.BASE_LR * group.get("lr_scale", 1.0)
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
    betas, wd = tuple(o.BETAS), o.WEIGHT_DECAY
    if o.OPTIMIZER == "adamw":
        return AdamW(groups, lr=o.BASE_LR, betas=betas, eps=o.EPS, weight_decay=wd, **common)
    return LAMB(groups, lr=o.BASE_LR, betas=betas, eps=o.EPS, weight_decay=wd, **common)
