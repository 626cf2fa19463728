"""The ViT's norm layers, one kind per model (``VitArgs.norm_layer``: LayerNorm or RMSNorm, and
``qk_norm`` for the queries and keys), and LayerScale, the learned per-channel scale of a residual
branch (``layer_scale_init``)."""

import torch
from torch import nn

NORMS = {"layer": nn.LayerNorm, "rms": nn.RMSNorm}


def make_norm(kind: str, width: int, eps: float) -> nn.Module:
    """A norm of ``kind`` ("layer" or "rms") over the last ``width`` features."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm {kind!r}; expected one of: {', '.join(NORMS)}")
    return NORMS[kind](width, eps=eps)


class LayerScale(nn.Module):
    """x * gamma, one learned scale per channel ("Going deeper with image transformers", Touvron
    et al. 2021), initialised to ``init_value``. The product keeps the branch's dtype: under
    autocast the branch is half while gamma is float32, and a float32 product would turn a
    bfloat16 residual stream (``VitArgs.residual_dtype``) to float32 at the addition.

    AMP O2 leaves gamma in float32 (``keeps_float32``, as the norms): DeiT III's initial 1e-6 is
    below float16's smallest normal number (6.1e-5), a subnormal there with 4 significant bits,
    and a scale's rounding multiplies the whole branch; a vector of ``width`` values costs
    nothing to keep. O3 casts it with everything else (bfloat16 holds 1e-6 with its usual 8
    bits)."""

    keeps_float32 = True

    def __init__(self, width: int, init_value: float):
        super().__init__()
        self.init_value = init_value
        self.gamma = nn.Parameter(torch.full((width,), float(init_value)))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.gamma.fill_(self.init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.gamma).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.gamma.shape[0]}, init_value={self.init_value}"


def layer_scale(width: int, init_value: float) -> nn.Module:
    """LayerScale initialised to ``init_value``, or an identity when it is 0 (off)."""
    return LayerScale(width, init_value) if init_value else nn.Identity()
