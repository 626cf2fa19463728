"""The ViT's feed-forward networks (``VitArgs.ffn``): the GELU MLP, SwiGLU with two input
projections or one packed, and the local feed-forward (LocalViT), each of hidden width
``VitArgs.ffn_hidden``, optionally bias-free (``proj_bias``) and, but the local one, with a norm
of the hidden activations (``ffn_norm``: EVA-02's sub-LN)."""

import torch
import torch.nn.functional as F
from torch import nn

from pycls.models.vit.position import grid_side


def _hidden_norm(norm, width):
    """``norm(width)`` (a callable making the model's norm), or an identity."""
    return norm(width) if norm is not None else nn.Identity()


class Mlp(nn.Module):
    """The standard transformer feed-forward network: Linear, GELU, Dropout, [norm], Linear,
    Dropout (timm's ``Mlp``; ``norm``: a callable making the hidden norm, or None)."""

    def __init__(self, *, width: int, mlp_dim: int, dropout: float = 0.0, bias: bool = True,
                 norm=None):  # fmt: skip
        super().__init__()
        self.fc1 = nn.Linear(width, mlp_dim, bias=bias)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(dropout)
        self.norm = _hidden_norm(norm, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width, bias=bias)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class SwiGLU(nn.Module):
    """SwiGLU ("GLU variants improve transformer", Shazeer 2020): SiLU(gate) * value, then the
    output projection; the gate and the value from two input projections, ``fc1_g`` and ``fc1_x``
    (timm's ``SwiGLU``, EVA-02's layout), each of ``mlp_dim`` outputs."""

    def __init__(self, *, width: int, mlp_dim: int, dropout: float = 0.0, bias: bool = True,
                 norm=None):  # fmt: skip
        super().__init__()
        self.fc1_g = nn.Linear(width, mlp_dim, bias=bias)
        self.fc1_x = nn.Linear(width, mlp_dim, bias=bias)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(dropout)
        self.norm = _hidden_norm(norm, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width, bias=bias)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop1(self.act(self.fc1_g(x)) * self.fc1_x(x))
        return self.drop2(self.fc2(self.norm(x)))


class PackedSwiGLU(nn.Module):
    """SwiGLU with one input projection ``fc1`` of 2 x ``mlp_dim`` outputs, the gate first then
    the value (timm's ``SwiGLUPacked`` / ``GluMlp`` with its gate first: DINOv2-giant's layout, and
    EVA-02's without the hidden norm): one matrix product instead of two."""

    def __init__(self, *, width: int, mlp_dim: int, dropout: float = 0.0, bias: bool = True,
                 norm=None):  # fmt: skip
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * mlp_dim, bias=bias)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(dropout)
        self.norm = _hidden_norm(norm, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width, bias=bias)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.drop2(self.fc2(self.norm(self.drop1(F.silu(gate) * value))))


class LocalFeedForward(nn.Module):
    """Feed-forward network with a 3x3 depthwise convolution over the patch grid (LocalViT).

    Linear -> Hardswish -> depthwise 3x3 Conv2d -> Hardswish -> Linear -> Dropout, as used in
    "Training a ViT from scratch in less than 24 hours with 1 GPU". The convolution mixes each
    hidden channel with its spatial neighbours, giving the locality bias that helps ViTs trained
    on little data. The grid side is inferred from the token count, so the module follows the
    model through ``set_image_size`` without being told. The first ``num_prefix_tokens`` tokens
    (the class token) have no grid position: they bypass the convolution (an identity step) but
    go through every pointwise layer.
    """

    def __init__(
        self,
        *,
        width: int,
        mlp_dim: int,
        num_prefix_tokens: int = 0,
        dropout: float = 0.0,
        batch_first: bool = True,
        bias: bool = True,
    ):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.batch_first = batch_first
        self.fc1 = nn.Linear(width, mlp_dim, bias=bias)
        self.act1 = nn.Hardswish()
        self.dwconv = nn.Conv2d(mlp_dim, mlp_dim, kernel_size=3, padding=1, groups=mlp_dim)
        self.act2 = nn.Hardswish()
        self.fc2 = nn.Linear(mlp_dim, width, bias=bias)
        self.drop = nn.Dropout(dropout)

    def _conv_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Depthwise conv over patch tokens given as (N, Lp, C) or (Lp, N, C)."""
        length = x.shape[1] if self.batch_first else x.shape[0]
        side = grid_side(length)
        grid = x.permute(0, 2, 1) if self.batch_first else x.permute(1, 2, 0)  # (N, C, Lp)
        grid = self.dwconv(grid.reshape(*grid.shape[:2], side, side)).flatten(2)
        return grid.transpose(1, 2) if self.batch_first else grid.permute(2, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.fc1(x))
        seq_dim = 1 if self.batch_first else 0
        prefix, patches = x.split(
            [self.num_prefix_tokens, x.shape[seq_dim] - self.num_prefix_tokens], dim=seq_dim
        )
        x = torch.cat([prefix, self._conv_patches(patches)], dim=seq_dim)
        return self.drop(self.fc2(self.act2(x)))


FEED_FORWARDS = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": PackedSwiGLU}


def make_ffn(kind, *, width, mlp_dim, dropout=0.0, bias=True, norm=None, num_prefix_tokens=0,
             batch_first=True):  # fmt: skip
    """The feed-forward ``kind`` (``VitArgs.ffn``) of hidden width ``mlp_dim``."""
    if kind == "local":
        return LocalFeedForward(width=width, mlp_dim=mlp_dim, num_prefix_tokens=num_prefix_tokens,
                                dropout=dropout, batch_first=batch_first, bias=bias)  # fmt: skip
    if kind not in FEED_FORWARDS:
        raise ValueError(f"unknown ffn {kind!r}; expected one of: 'mlp', 'local', 'swiglu', "
                         "'swiglu_packed'")  # fmt: skip
    return FEED_FORWARDS[kind](width=width, mlp_dim=mlp_dim, dropout=dropout, bias=bias, norm=norm)
