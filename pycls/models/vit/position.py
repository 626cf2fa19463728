"""The ViT's position embedding: the patch grid of a token count, the fixed 2-D sin-cos table,
bicubic resampling of a learned table to another grid, and what a size change in training carries
along (optimizer state and EMA of the table's shape)."""

import math

import torch
import torch.nn.functional as F


def grid_side(num_patches: int) -> int:
    """Side of the square patch grid holding ``num_patches`` tokens."""
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"{num_patches} patch tokens do not form a square grid")
    return side


def sincos_pos_embed(
    grid: int | tuple[int, int], width: int, *, temperature: float = 10000.0
) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding of a ``grid`` x ``grid`` patch grid (or an (h, w)
    grid, row-major), (grid**2 or h * w, width).

    As in "Better plain ViT baselines for ImageNet-1k": a quarter of the channels each hold
    sin(x), cos(x), sin(y), cos(y) at geometrically spaced frequencies. Computed in float64 so
    the table does not depend on the default dtype, then returned in float32.
    """
    if width % 4 != 0:
        raise ValueError(f"sincos position embedding needs width divisible by 4, got {width}")
    quarter = width // 4
    omega = torch.arange(quarter, dtype=torch.float64) / max(quarter - 1, 1)
    omega = 1.0 / temperature**omega
    rows, cols = (grid, grid) if isinstance(grid, int) else grid
    ys, xs = torch.meshgrid(
        torch.arange(rows, dtype=torch.float64),
        torch.arange(cols, dtype=torch.float64),
        indexing="ij",
    )
    x_angles = xs.flatten()[:, None] * omega[None, :]
    y_angles = ys.flatten()[:, None] * omega[None, :]
    table = torch.cat([x_angles.sin(), x_angles.cos(), y_angles.sin(), y_angles.cos()], dim=1)
    return table.float()


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: int | tuple[int, int],
    *,
    num_prefix_tokens: int | None = None,
) -> torch.Tensor:
    """Bicubically resample a (1, prefix + g*g, D) position embedding to a new patch grid.

    The prefix (class token) rows have no grid position and are kept as they are. When
    ``num_prefix_tokens`` is None it is inferred from the length: 0 if it is a square, 1 if
    one less is a square (both cannot hold for a length above 1). Works on any tensor of that
    shape, e.g. Adam's moments of the embedding; note that bicubic overshoot can make a
    resampled non-negative tensor (a second moment) slightly negative, so clamp such state.
    """
    if pos_embed.ndim != 3 or pos_embed.shape[0] != 1:
        raise ValueError(f"expected a (1, L, D) position embedding, got {tuple(pos_embed.shape)}")
    length = pos_embed.shape[1]
    if num_prefix_tokens is None:
        num_prefix_tokens = 0 if math.isqrt(length) ** 2 == length else 1
    old = grid_side(length - num_prefix_tokens)
    new_h, new_w = (new_grid, new_grid) if isinstance(new_grid, int) else new_grid
    prefix, patches = pos_embed.split([num_prefix_tokens, length - num_prefix_tokens], dim=1)
    grid = patches.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    # antialias only acts when shrinking, where it keeps the table from aliasing.
    grid = F.interpolate(grid, size=(new_h, new_w), mode="bicubic", antialias=True)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_h * new_w, -1).to(pos_embed.dtype)
    return torch.cat([prefix, patches], dim=1)


# Optimizer state that must stay non-negative after resampling (bicubic overshoot)
_NON_NEGATIVE_STATE = ("exp_avg_sq", "max_exp_avg_sq")


def _resample_like(tensor, old_shape, grid, num_prefix_tokens, key):
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(old_shape):
        return tensor
    out = resample_pos_embed(tensor, grid, num_prefix_tokens=num_prefix_tokens)
    return out.clamp_(min=0) if key in _NON_NEGATIVE_STATE else out


def carry_to_new_grid(vit, old_shape, optimizer=None, ema=None):
    """After ``vit``'s position embedding went from ``old_shape`` to its new grid (the
    image-size curriculum): every optimizer state tensor of the old shape (Adam's moments,
    momentum, O2 master weights) resampled in place, and the EMA's copy. Optimizers keep referring
    to the parameter they were built with: replacing the Parameter instead would leave the
    optimizer updating a stale tensor that the model no longer uses."""
    pos = vit.pos_embed
    learned = isinstance(pos, torch.nn.Parameter)
    grid, prefix = vit.grid_size, vit.num_prefix_tokens
    if learned and optimizer is not None:
        state = optimizer.state.get(pos, {})
        for key, value in list(state.items()):
            state[key] = _resample_like(value, old_shape, grid, prefix, key)
    if ema is not None:
        named = dict(vit.named_parameters())
        named.update(vit.named_buffers())
        for i, name in enumerate(ema.names):
            if name.endswith("pos_embed") and ema.tensors[i].shape != named[name].shape:
                if learned:
                    ema.tensors[i] = resample_pos_embed(
                        ema.tensors[i], grid, num_prefix_tokens=prefix
                    )
                else:  # a fixed table: its average is itself
                    ema.tensors[i] = named[name].detach().float().clone()
    if learned and getattr(optimizer, "contiguous", False):
        # the flat buffers have the old size; built after the EMA, whose copies of the
        # parameters a one-pass optimizer keeps in buffers of its own
        optimizer.rebuild_contiguous()
