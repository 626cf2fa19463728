"""Re-export shim: the ViT's blocks (attention, MLP, local feed-forward, drop-path, stems, sin-cos
embedding) now live in ``pycls.models.vit.blocks``, the ViT's one home. This module re-exports
their names so that ``pycls.models.blocks`` keeps working."""

from pycls.models.vit.blocks import (
    NORM_TYPES,
    Attention,
    ConvBnReLU,
    ConvStem,
    DropPath,
    EncoderBlock,
    LocalFeedForward,
    Mlp,
    PatchifyStem,
    grid_side,
    sincos_pos_embed,
)

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
