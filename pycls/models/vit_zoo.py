"""Re-export shim: the named ViT variants (vit_ti16 ... vit_22b14) now live in
``pycls.models.vit.variants``, the ViT's one home. This module re-exports their names so that
``pycls.models.vit_zoo`` keeps working."""

from pycls.models.vit.variants import (
    VIT_SPECS,
    build_vit,
    list_vit_models,
    vit_22b14,
    vit_b16,
    vit_b32,
    vit_bigg14,
    vit_g14,
    vit_h14,
    vit_h16,
    vit_l16,
    vit_s16,
    vit_ti16,
)

__all__ = [
    "VIT_SPECS",
    "build_vit",
    "list_vit_models",
    "vit_22b14",
    "vit_b16",
    "vit_b32",
    "vit_bigg14",
    "vit_g14",
    "vit_h14",
    "vit_h16",
    "vit_l16",
    "vit_s16",
    "vit_ti16",
]
