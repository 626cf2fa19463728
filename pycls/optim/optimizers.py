"""Fused optimizers (SGD, AdamW, LAMB) and Muon beside AdamW (the parameter groups they train and
what builds them: ``pycls.optim.optimizer_settings``).

SGD and AdamW run torch's fused kernels (``torch._fused_sgd_``, ``torch._fused_adamw_``, the ops
behind ``torch.optim.SGD/AdamW(fused=True)``, exactly torch.optim's update): one pass over each
tensor per step, nothing allocated. LAMB runs the same AdamW kernel (see LAMB). Two options go
further, and float16 gets special care:

- ``contiguous=True``: the parameters and gradients of each (group, device, dtype) become views into
  one flat buffer, so each fused call gets a single large tensor. Build the optimizer after the
  model is on its device and cast (``model.to()`` afterwards would replace
  the views; a parameter whose shape changes needs ``rebuild_contiguous()``). In this mode every
  parameter of a bucket is stepped together: a gradient left at ``None`` counts as zero (weight
  decay and momentum still apply), and ``zero_grad()`` zeroes the buffer in place whatever
  ``set_to_none`` says, so the views survive.
- ``master_weights=True`` (AMP level O2): half-precision parameters get an fp32 copy in the
  optimizer state (``master``); the update runs in fp32 on the copy, one tensor at a time with the
  gradient copied into a kept fp32 buffer, and is written back rounded.
  Moments of those parameters are fp32 too. fp32 parameters (the norms under O2) need no copy.
- float16 parameters without master weights (AMP level O3) still keep fp32 moments and are updated
  through a kept fp32 buffer: in float16, ``v = g^2`` is 0 for ``|g| < 2.4e-4`` and ``eps =
  1e-8`` rounds to 0, so Adam would divide by zero. bfloat16 has fp32's range and stays bfloat16
  (the fused kernels compute in fp32 and round once).

State dicts have torch.optim's per-parameter layout (``step``, ``momentum_buffer``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``, plus ``master`` under O2), so checkpoints move between modes and
from torch.optim into these classes. Step counts stay 0-d CPU tensors (torch.optim's unfused
layout); the fused kernels get a device copy where the parameters live elsewhere.
"""

import torch
from torch.distributed.tensor import DTensor

from pycls.optim import muon
from pycls.optim.flat_buffers import Bucket, views_like

__all__ = ["SGD", "AdamW", "LAMB", "Muon"]

_HALF = (torch.float16, torch.bfloat16)


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
        self._buckets, self._scratches = [], {}
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
            bucket = Bucket(
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
        buffers = {k: [s[k] for s in states] for k in self._state_keys(group)}
        if self._state_dtype(params[0]) == params[0].dtype:
            self._update(group, params, [p.grad for p in params], buffers, steps, None)
            return
        # The update runs in fp32 on the master copy (or on a copy of the weight), one tensor at a
        # time, the gradient (and weight) copied into kept fp32 buffers: nothing allocated
        grads32 = self._scratch("grad", params, torch.float32)
        weights32 = None if with_master else self._scratch("weight", params, torch.float32)
        for i, p in enumerate(params):
            if isinstance(p, DTensor):  # a tensor-parallel part: fp32 copies of the DTensors
                grad = p.grad.float()
                target = states[i]["master"] if with_master else p.float()
            else:
                grad = grads32[: p.numel()].view_as(p).copy_(p.grad)
                if with_master:
                    target = states[i]["master"]
                else:
                    target = weights32[: p.numel()].view_as(p).copy_(p)
            state = {k: [v[i]] for k, v in buffers.items()}
            self._update(group, [target], [grad], state, steps[i : i + 1], None)
            p.copy_(target)

    def _scratch(self, name, like, dtype):
        """A flat buffer as large as the largest of ``like``, kept across steps (not saved)."""
        key = (name, like[0].device, dtype)
        size = max([t.numel() for t in like if not isinstance(t, DTensor)], default=0)
        if key not in self._scratches or self._scratches[key].numel() < size:
            self._scratches[key] = torch.empty(size, dtype=dtype, device=like[0].device)
        return self._scratches[key]

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
            segments = views_like(target, bucket.params)
        if grad.dtype != target.dtype:
            grad = grad.float()
        group = self.param_groups[bucket.group_index]
        buffers = {k: [bucket.state[k].flat] for k in self._state_keys(group)}
        self._update(group, [target], [grad], buffers, steps[:1], segments)
        if target is not data:
            data.copy_(target)

    def _update(self, group, params, grads, buffers, steps, segments):
        """One update of same-dtype tensors; ``steps`` are the (already advanced) 0-d CPU step
        counts, one per tensor."""
        raise NotImplementedError


def _local(tensors):
    """Each process's own part of sharded tensors (FSDP2's DTensors), views sharing storage: the
    fused SGD kernel has no DTensor rule, and its update is elementwise, so each shard updates
    in place on its own."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _device_steps(steps, device):
    """The step counts on the parameters' device, where fused kernels read them (one copy)."""
    if device.type == "cpu":
        return steps
    return list(torch.stack(steps).to(device, non_blocking=True).unbind())


class SGD(_MultiTensorOptimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay: torch.optim.SGD's update.

    With ``g = grad + wd * w``: ``b = g`` on the first step, then ``b = momentum * b +
    (1 - dampening) * g``; the step is ``w -= lr * (g + momentum * b)`` (Nesterov) or
    ``w -= lr * b``; without momentum, ``w -= lr * g``. One fused kernel
    (``torch._fused_sgd_``) per call.
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
        keys = ("weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize")
        kwargs = {k: group[k] for k in keys}
        params, grads = _local(params), _local(grads)
        if group["momentum"] == 0:
            torch._fused_sgd_(params, grads, [], is_first_step=False, **kwargs)
            return
        bufs = _local(buffers["momentum_buffer"])
        # As torch.optim, the buffer starts as the first gradient: the kernel's first-step mode.
        # Tensors whose first step this is (a parameter that had no gradient before) go apart.
        first = [float(s) == 1 for s in steps]
        for is_first in (True, False):
            idx = [i for i, f in enumerate(first) if f == is_first]
            if idx:
                lists = [[xs[i] for i in idx] for xs in (params, grads, bufs)]
                torch._fused_sgd_(*lists, is_first_step=is_first, **kwargs)


class AdamW(_MultiTensorOptimizer):
    """Adam with decoupled weight decay (torch.optim.AdamW's update), optional AMSGrad.

    ``w *= 1 - lr * wd``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2`` (AMSGrad uses the
    running maximum of ``v``); ``w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
    One fused kernel (``torch._fused_adamw_``) per call.
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
        _fused_adamw(group, params, grads, buffers, steps)


def _fused_adamw(group, params, grads, buffers, steps):
    """AdamW's update of same-dtype tensors with the settings of ``group`` (one fused kernel)."""
    beta1, beta2 = group["betas"]
    kwargs = {k: group[k] for k in ("lr", "weight_decay", "eps", "amsgrad", "maximize")}
    moments = [buffers[k] for k in ("exp_avg", "exp_avg_sq")]
    max_sq, steps = buffers.get("max_exp_avg_sq", []), _device_steps(steps, params[0].device)
    torch._fused_adamw_(params, grads, *moments, max_sq, steps, beta1=beta1, beta2=beta2, **kwargs)


class LAMB(_MultiTensorOptimizer):
    """LAMB (You et al., 2019, "Large batch optimization for deep learning").

    Adam moments with bias correction, ``m̂ = m / (1 - b1^t)`` and ``v̂ = v / (1 - b2^t)``; the
    update ``u = m̂ / (sqrt(v̂) + eps) + wd * w`` is scaled per parameter tensor by the trust ratio
    ``r = ||w|| / ||u||`` (1 where either norm is 0): ``w -= lr * r * u``. As in common
    implementations, tensors without weight decay (norms, biases) take the plain Adam step
    (``r = 1``) unless ``always_adapt``. No gradient clipping inside: use OPTIM.CLIP_GRAD.

    The ratio needs all of a tensor's ``u`` before any is applied: two reads where AdamW makes
    one. Per tensor, ``u = wd * w`` in a kept scratch buffer, then torch's fused AdamW kernel on
    ``u`` (``lr = -1``, no decay) updates the moments and adds ``m̂ / (sqrt(v̂) + eps)`` to ``u`` in
    one pass; the norms and ``w -= lr r u`` follow while the tensor is in cache.
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
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        adam = dict(beta1=beta1, beta2=beta2, eps=group["eps"], amsgrad=False, maximize=False)
        exp_avg, exp_avg_sq = buffers["exp_avg"], buffers["exp_avg_sq"]
        steps = _device_steps(steps, params[0].device)
        if wd == 0 and not group["always_adapt"]:  # r = 1 and u = m̂ / (sqrt(v̂) + eps): Adam
            torch._fused_adamw_(
                params, grads, exp_avg, exp_avg_sq, [], steps, lr=lr, weight_decay=0.0, **adam
            )
            return
        if segments is not None:  # contiguous: the trust ratio is per parameter, so per view
            params, steps = segments, steps * len(segments)
            grads = views_like(grads[0], segments)
            exp_avg, exp_avg_sq = (
                views_like(exp_avg[0], segments),
                views_like(exp_avg_sq[0], segments),
            )
        # A sharded parameter (FSDP's DTensor) needs its update as a DTensor too: a new tensor
        # per step there, the kept scratch buffer everywhere else
        plain = type(params[0]) in (torch.Tensor, torch.nn.Parameter)
        scratch = self._scratch("lamb", params, params[0].dtype) if plain else None
        for w, g, m, v, step in zip(params, grads, exp_avg, exp_avg_sq, steps):
            if plain:
                u = torch.mul(w, wd, out=scratch[: w.numel()].view_as(w))
            else:
                u = torch.mul(w, wd)
            # u - (-1) * m̂ / (sqrt(v̂) + eps), the moments updated on the way
            torch._fused_adamw_([u], [g], [m], [v], [], [step], lr=-1.0, weight_decay=0.0, **adam)
            w.addcmul_(u, _trust_ratio(w, u), value=-lr)


class Muon(_MultiTensorOptimizer):
    """Muon for the groups marked ``use_muon`` (2-D weights: the momentum orthogonalised, see
    ``pycls.optim.muon``), AdamW for every other group, in one optimizer: one schedule, one state
    dict, one step, as the trainer expects of any optimizer.

    Muon groups take ``lr``, ``weight_decay`` (decoupled), ``momentum``, ``nesterov``,
    ``ns_steps``, ``ns_coefficients``, ``ns_eps`` and ``adjust_lr``; AdamW groups ``lr``,
    ``betas``, ``eps`` and ``weight_decay``, as ``AdamW``. Each group may set its own. The state
    of a Muon weight is torch.optim.Muon's ``momentum_buffer`` (plus ``step``), that of the others
    AdamW's moments.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        adjust_lr="match_rms_adamw",
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.05,
        *,
        contiguous=False,
        master_weights=False,
    ):
        _check_adam_args("Muon", lr, betas, eps, weight_decay)
        if not 0.0 <= momentum < 1.0 or ns_steps < 1:
            raise ValueError(f"Muon: invalid momentum={momentum} or ns_steps={ns_steps}")
        muon.shape_scale((1, 1), adjust_lr)  # refuses an unknown rule
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        defaults.update(amsgrad=False, maximize=False, use_muon=False)
        defaults.update(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        defaults.update(ns_coefficients=muon.NS_COEFFICIENTS, ns_eps=muon.NS_EPS)
        defaults["adjust_lr"] = adjust_lr
        super().__init__(params, defaults, contiguous=contiguous, master_weights=master_weights)
        for group in self.param_groups:
            flat = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
            if group["use_muon"] and flat:
                raise ValueError(f"Muon: a use_muon group holds tensors of shapes {flat}, not 2-D")

    def _state_keys(self, group):
        return ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq")

    def _update(self, group, params, grads, buffers, steps, segments):
        if not group["use_muon"]:
            _fused_adamw(group, params, grads, buffers, steps)
            return
        momenta = buffers["momentum_buffer"]
        if segments is not None:  # contiguous: one flat tensor; each matrix is its own view
            params, grads = segments, views_like(grads[0], segments)
            momenta = views_like(momenta[0], segments)
        muon.muon_update(params, grads, momenta, group)


def _trust_ratio(w, u):
    """LAMB's ``||w|| / ||u||`` (1 where either is 0), a 0-d tensor: no device sync."""
    w_norm, u_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(u)
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))


def _check_adam_args(name, lr, betas, eps, weight_decay):
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"{name}: invalid lr={lr}, eps={eps} or weight_decay={weight_decay}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: betas must be two values in [0, 1), got {betas}")
