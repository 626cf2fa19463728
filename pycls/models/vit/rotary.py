"""2-D rotary position embedding (RoPE) of the ViT's queries and keys (``VitArgs.rope``).

A token's position is two coordinates, row and column of its patch (``grid_positions``); each
attention turns pairs of its heads' query and key channels by angles proportional to them
(``Rotary``), so that the product of a query and a key depends on their relative position
("RoFormer", Su et al. 2021; for images "Rotary Position Embedding for Vision Transformer", Heo
et al. 2024). Three kinds, as timm 1.0.31 builds them (``timm/layers/pos_embed_sincos.py``:
``RotaryEmbeddingCat``, ``RotaryEmbeddingMixed``, ``RotaryEmbeddingDinoV3``):

- "axial": of a head's d / 2 pairs, the first d / 4 turn with the first coordinate, the rest with
  the second, pair k at ``temperature ** (-k / (d/4))`` radians per patch; coordinates are patch
  indices, or scaled so that any grid spans ``ref_grid`` patches (EVA-02);
- "mixed": each head of each block learns two frequencies per pair, one per axis (``freqs``),
  and a pair turns by their sum;
- "dinov3": as axial, on coordinates normalised per axis to [-1, 1] (patch centres), pair k with
  the period ``temperature ** (k / (d/4))``.

The pairs are adjacent channels ("interleaved") or channel i with i + d/2 ("half"). The model
computes the coordinates of the tokens a forward pass runs (``token_positions``: its grid, the
patches patch dropout keeps, each image of a token batch), the class and register tokens at
(0, 0), where every kind's angle is 0 and the turn the identity; each block's attention turns
with them.
"""

import math

import torch
from torch import nn

__all__ = ["Rotary", "grid_positions", "token_positions"]


def _axis(kind: str, side: int, ref_grid: int, device) -> torch.Tensor:
    if kind == "dinov3":  # patch centres in [0, 1], mapped to [-1, 1] once stacked (as timm)
        return torch.arange(0.5, side, device=device, dtype=torch.float32) / side
    t = torch.arange(side, device=device, dtype=torch.int64).to(torch.float32)
    return t / side * ref_grid if ref_grid else t


def grid_positions(kind, h, w, *, ref_grid=0, indexing="ij", device=None) -> torch.Tensor:
    """The (h * w, 2) float32 coordinates of an h x w patch grid, row-major: (row, column) for
    ``indexing`` "ij", (column, row) for "xy"."""
    rows, cols = torch.meshgrid(
        _axis(kind, h, ref_grid, device), _axis(kind, w, ref_grid, device), indexing="ij"
    )
    grid = torch.stack([rows, cols] if indexing == "ij" else [cols, rows], dim=-1)
    if kind == "dinov3":
        grid = 2.0 * grid - 1.0
    return grid.reshape(h * w, 2)


def token_positions(kind, h, w, num_prefix_tokens, **grid) -> torch.Tensor:
    """The coordinates of a sequence of ``num_prefix_tokens`` prefix tokens (at (0, 0): not
    turned) and an h x w grid of patches, (L, 2)."""
    patches = grid_positions(kind, h, w, **grid)
    return torch.cat([patches.new_zeros(num_prefix_tokens, 2), patches])


def _pairs(values: torch.Tensor, half: bool) -> torch.Tensor:
    """One value per pair (..., d/2) -> one per channel (..., d), in the pairs' layout."""
    return torch.cat([values, values], dim=-1) if half else values.repeat_interleave(2, -1)


def _turn(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, half: bool) -> torch.Tensor:
    """Each pair of ``x``'s channels turned by its angle; in x's dtype."""
    if half:
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
    else:
        rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)
    return (x * cos + rotated * sin).to(x.dtype)


class Rotary(nn.Module):
    """The rotation of one attention's queries and keys (N, heads, L, head_dim) by the tokens'
    ``positions`` ((L, 2), one sequence for the batch, or (N, L, 2), one per sequence).

    Only "mixed" has parameters: ``freqs`` (2, heads, head_dim / 2), each head's frequencies along
    the first and the second coordinate (initialised as RoPE-Mixed: magnitudes of the axial
    frequencies, each head's pairs in directions at a random angle). The angles are computed in
    float32 whatever the model's dtype, and under AMP O2 ``freqs`` stays float32
    (``keeps_float32``): rounded to half, the angles of far positions would drift.
    """

    keeps_float32 = True

    def __init__(self, kind, *, head_dim, num_heads, temperature=10000.0, layout="interleaved"):
        super().__init__()
        if kind not in ("axial", "mixed", "dinov3") or layout not in ("interleaved", "half"):
            raise ValueError(f"unknown rope {kind!r} or layout {layout!r}")
        self.kind, self.head_dim, self.temperature = kind, head_dim, float(temperature)
        self.half = layout == "half"
        if kind == "mixed":
            self.freqs = nn.Parameter(torch.empty(2, num_heads, head_dim // 2))
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.kind != "mixed":
            return
        hd, heads = self.head_dim, self.freqs.shape[1]
        exponent = torch.arange(0, hd, 4, dtype=torch.float32) / hd
        magnitude = 1.0 / (self.temperature**exponent)
        theta = torch.rand(heads, 1) * 2 * math.pi
        fx = torch.cat([magnitude * theta.cos(), magnitude * (theta + math.pi / 2).cos()], -1)
        fy = torch.cat([magnitude * theta.sin(), magnitude * (theta + math.pi / 2).sin()], -1)
        self.freqs.copy_(torch.stack([fx, fy]))

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """One angle per pair: (..., 1 or heads, L, head_dim / 2) for positions (..., L, 2)."""
        positions = positions.float()
        if self.kind == "mixed":
            freqs = self.head_frequencies().float()
            along = [positions[..., i].unsqueeze(-2).unsqueeze(-1) * freqs[i].unsqueeze(-2)
                     for i in (0, 1)]  # fmt: skip
            return along[0] + along[1]
        n = self.head_dim // 4
        steps = torch.arange(n, device=positions.device, dtype=torch.int64).to(torch.float32)
        if self.kind == "axial":
            angles = positions.unsqueeze(-1) * (1.0 / (self.temperature ** (steps / n)))
        else:
            periods = self.temperature ** (2.0 * steps / (self.head_dim // 2))
            angles = 2 * math.pi * positions.unsqueeze(-1) / periods
        return angles.flatten(-2).unsqueeze(-3)

    def head_frequencies(self) -> torch.Tensor:
        """The mixed kind's ``freqs``. Under tensor parallelism each process turns its own heads
        (``pycls.models.vit.tensor_plan`` gives the module its own)."""
        return self.freqs

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        angles = self.angles(positions)
        sin, cos = _pairs(angles.sin(), self.half), _pairs(angles.cos(), self.half)
        return _turn(q, sin, cos, self.half), _turn(k, sin, cos, self.half)

    def extra_repr(self) -> str:
        layout = "half" if self.half else "interleaved"
        return f"{self.kind}, temperature={self.temperature}, layout={layout}"
