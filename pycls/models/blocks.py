"""Re-export shim: the ViT's blocks (attention, MLP, local feed-forward, drop-path, stems, sin-cos
embedding) now live in ``pycls.models.vit.blocks`` and ``pycls.models.vit.position``, the ViT's
one home, and the norm layers' tuple and the buffers a checkpoint holds in
``pycls.models.groups``. This module re-exports their names so that ``pycls.models.blocks`` keeps
working."""

from pycls.models.groups import NORM_TYPES, named_saved_buffers
from pycls.models.vit.blocks import (
    SDPA_BACKENDS,
    Attention,
    ConvBnReLU,
    ConvStem,
    DropPath,
    EncoderBlock,
    LocalFeedForward,
    Mlp,
    PatchifyStem,
    place_rates,
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
    "SDPA_BACKENDS",
    "grid_side",
    "named_saved_buffers",
    "place_rates",
    "sincos_pos_embed",
]
