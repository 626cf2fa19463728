"""The Vision Transformer: the model (``transformer``) and its import from torchvision and timm
(``from_libraries``), all importable from here (``from pycls.models.vit import from_timm``)."""

from pycls.models.vit.from_libraries import from_timm, from_torchvision
from pycls.models.vit.transformer import (
    CLASSIFIERS,
    FFNS,
    LAYOUTS,
    POS_EMBEDS,
    RESIDUAL_DTYPES,
    STEMS,
    VisionTransformer,
    resample_pos_embed,
)

__all__ = [
    "CLASSIFIERS",
    "FFNS",
    "LAYOUTS",
    "POS_EMBEDS",
    "RESIDUAL_DTYPES",
    "STEMS",
    "VisionTransformer",
    "from_timm",
    "from_torchvision",
    "resample_pos_embed",
]
