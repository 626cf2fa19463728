"""Re-export shim: the ViT's blocks (attention, MLP, local feed-forward, drop-path, stems, sin-cos
embedding) now live in ``pycls.models.vit.blocks`` and ``pycls.models.vit.position``, the ViT's
one home, and the norm layers' tuple in ``pycls.models.groups``. This module re-exports their names
so that ``pycls.models.blocks`` keeps working."""

from pycls.models.groups import NORM_TYPES
from pycls.models.vit.blocks import (
    Attention,
    ConvBnReLU,
    ConvStem,
    DropPath,
    EncoderBlock,
    LocalFeedForward,
    Mlp,
    PatchifyStem,
)
from pycls.models.vit.position import grid_side, sincos_pos_embed

__all__ = [
    "Attention",
    "ConvBnReLU",
    "ConvStem",
    "DropPath",
    "EncoderBlock",
    "LocalFeedForward",
    "Mlp",
    "NORM_TYPES",
    "PatchifyStem",
    "grid_side",
    "sincos_pos_embed",
]
