"""Models: the Vision Transformer, its named variants, its analytic complexity and its parameter
groups.

Nothing here imports ``pycls.core``: models take explicit arguments, and the builders that
read the config live on the core side.
"""

from pycls.models.complexity import vit_complexity
from pycls.models.model_zoo import (
    VIT_SPECS,
    build_vit,
    list_models,
    vit_b16,
    vit_b32,
    vit_h14,
    vit_h16,
    vit_l16,
    vit_s16,
    vit_ti16,
)
from pycls.models.vit import VisionTransformer, from_torchvision, resample_pos_embed

__all__ = [
    "VIT_SPECS",
    "VisionTransformer",
    "build_vit",
    "from_torchvision",
    "list_models",
    "resample_pos_embed",
    "vit_b16",
    "vit_b32",
    "vit_complexity",
    "vit_h14",
    "vit_h16",
    "vit_l16",
    "vit_s16",
    "vit_ti16",
]
