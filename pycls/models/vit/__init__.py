"""The Vision Transformer: the model (``transformer``) and its import from torchvision and timm
(``from_libraries``), all importable from here (``from pycls.models.vit import from_timm``)."""

from pycls.models.vit.from_libraries import from_timm, from_torchvision
from pycls.models.vit.position import resample_pos_embed
from pycls.models.vit.transformer import (
    CLASSIFIERS,
    FFNS,
    LAYOUTS,
    POS_EMBEDS,
    STEMS,
    VisionTransformer,
)

__all__ = [
    "CLASSIFIERS",
    "FFNS",
    "LAYOUTS",
    "POS_EMBEDS",
    "STEMS",
    "VisionTransformer",
    "from_timm",
    "from_torchvision",
    "resample_pos_embed",
]
