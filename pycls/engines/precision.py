"""AMP levels O0-O3 in float16 or bfloat16, built on torch.autocast.

| level | weights          | compute          | optimizer           | loss scaling       |
|-------|------------------|------------------|---------------------|--------------------|
| O0    | fp32             | fp32             | fp32                | none               |
| O1    | fp32             | autocast to half | fp32                | dynamic, fp16 only |
| O2    | half, norms fp32 | autocast to half | fp32 master weights | dynamic, fp16 only |
| O3    | half, everything | half             | half (see below)    | dynamic, fp16 only |

bfloat16 has fp32's exponent range, so it never needs loss scaling and its steps need no host sync.
Under O3 with float16 the optimizer still keeps fp32 moments and updates through a temporary fp32
copy (float16 Adam moments underflow to 0 and its ``eps`` rounds to 0, which divides by zero); with
bfloat16, O3 is bfloat16 throughout.

float16 scaling follows torch.amp.GradScaler's algorithm (the same fused check-and-unscale kernel),
written here because GradScaler refuses half-precision gradients, which O2 and O3 have; like
GradScaler, deciding whether to skip a step costs one host sync per step.
"""

import contextlib

import torch

from pycls.engines.settings import AMP_DTYPES, AMP_LEVELS
from pycls.models.groups import keeps_float32

DTYPES = {name: getattr(torch, name) for name in AMP_DTYPES}


class Precision:
    """One AMP level: how to cast the model, which autocast to enter, which loss scaler to use."""

    def __init__(self, level="O0", dtype="bfloat16", device_type="cpu"):
        if level not in AMP_LEVELS:
            raise ValueError(f"AMP.LEVEL {level!r} is not one of {list(AMP_LEVELS)}")
        if dtype not in DTYPES:
            raise ValueError(f"AMP.DTYPE {dtype!r} is not one of {list(DTYPES)}")
        self.level, self.dtype, self.device_type = level, DTYPES[dtype], device_type

    @property
    def enabled(self):
        return self.level != "O0"

    @property
    def compute_dtype(self):
        """The dtype the matmuls run in: the level's half type, or float32 at O0."""
        return self.dtype if self.enabled else torch.float32

    @property
    def master_weights(self):
        """O2 keeps fp32 master weights in the optimizer."""
        return self.level == "O2"

    @property
    def uses_loss_scaling(self):
        return self.enabled and self.dtype == torch.float16

    @property
    def param_dtype(self):
        return self.dtype if self.level in ("O2", "O3") else torch.float32

    def prepare_model(self, model):
        """Casts the weights for O2 (all but norms) and O3 (all); returns the model. The
        drop-path rates stay float32 at every level (``blocks.DropPath``)."""
        if self.level == "O3":
            return model.to(self.dtype)
        if self.level == "O2":
            for module in model.modules():
                if keeps_float32(module):
                    continue
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(self.dtype)
                for name, b in module.named_buffers(recurse=False):
                    if b.is_floating_point():
                        setattr(module, name, b.to(self.dtype))
        return model

    def autocast(self):
        """Context for the forward pass (autocast for O1/O2; O3 is already all half)."""
        if self.level in ("O1", "O2"):
            return torch.autocast(self.device_type, dtype=self.dtype)
        return contextlib.nullcontext()

    def cast_input(self, x):
        return x.to(self.dtype) if self.level == "O3" else x

    def make_scaler(self, device):
        return DynamicLossScaler(device) if self.uses_loss_scaling else NoLossScaler()


class NoLossScaler:
    """fp32 and bfloat16: the loss is used as is and every step is taken."""

    skipped_steps = 0
    consecutive_skips = 0

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer):
        optimizer.step()
        return True

    def update(self):
        pass

    def get_scale(self):
        return 1.0

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class DynamicLossScaler:
    """Dynamic loss scaling for float16 with any gradient dtype (fp32, or half under O2/O3).

    The scale doubles after ``growth_interval`` clean steps and halves on an overflow; an
    overflowing step is skipped and counted in ``skipped_steps``.
    """

    def __init__(
        self,
        device,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
    ):
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.skipped_steps = 0
        self.consecutive_skips = 0  # skipped steps since the last one taken
        self._unscaled = False

    def scale(self, loss):
        return loss.float() * self._scale  # in fp32: a scaled fp16 loss would overflow itself

    def unscale_(self, optimizer):
        """Divides the gradients by the scale in place and records whether any is inf/NaN."""
        if self._unscaled:
            return
        self._found_inf.zero_()
        inv_scale = self._scale.double().reciprocal().float()
        grads = {}
        for grad in _grad_tensors(optimizer):
            grads.setdefault((grad.device, grad.dtype), []).append(grad)
        for device_grads in grads.values():
            torch._amp_foreach_non_finite_check_and_unscale_(
                device_grads, self._found_inf, inv_scale
            )
        self._unscaled = True

    def step(self, optimizer):
        """Unscales if needed, then steps unless a gradient overflowed; returns whether it did."""
        self.unscale_(optimizer)
        if self._found_inf.item():  # the one host sync per step that float16 scaling needs
            self.skipped_steps += 1
            self.consecutive_skips += 1
            return False
        optimizer.step()
        self.consecutive_skips = 0
        return True

    def update(self):
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            self._found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        self._unscaled = False

    def get_scale(self):
        return float(self._scale)

    def state_dict(self):
        return {
            "scale": float(self._scale),
            "growth_tracker": int(self._growth_tracker),
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state):
        self._scale.fill_(state["scale"])
        self._growth_tracker.fill_(state["growth_tracker"])
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)


def _grad_tensors(optimizer):
    """The optimizer's gradients: its flat buffers if it keeps them (pycls's contiguous mode)."""
    if hasattr(optimizer, "grad_tensors"):
        return optimizer.grad_tensors()
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
