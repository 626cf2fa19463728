"""Named Vision Transformer variants: thin functions over one spec table (``VIT_SPECS``, in
``pycls.models.vit.args``).

Sizes follow "An image is worth 16x16 words" (B, L, H), DeiT (Ti, S), "Scaling Vision
Transformers" (Zhai et al., 2022: g/14 and G/14, here ``vit_g14`` and ``vit_bigg14``) and
"Scaling Vision Transformers to 22 Billion Parameters" (Dehghani et al., 2023: ViT-22B's width,
depth, heads, MLP and patch, on this library's standard block), and DeiT III ("DeiT III: Revenge
of the ViT", Touvron et al. 2022: S/16, B/16, L/16, H/14 with LayerScale, ``deit3_*``). Any
constructor argument can be overridden, e.g. ``vit_b16(image_size=384, drop_path=0.1)``.

Defaults are those of ``VisionTransformer``, the original ViT's: 224 px images, 1000 classes, a
class-token classifier (``classifier="token"``) and batch-first tokens (``layout="batch_first"``),
like torchvision's and timm's ViTs. The config tree has the same defaults (VIT.CLASSIFIER,
VIT.LAYOUT); the recipes in configs/ that train from scratch ask for ``classifier="pooled"``, the
small-image ones (quickstart, CIFAR) also for ``layout="batch_second"``.
"""

from pycls.models.vit.args import VIT_SPECS
from pycls.models.vit.transformer import VisionTransformer


def list_vit_models() -> list[str]:
    """Names accepted by ``build_vit``."""
    return sorted(VIT_SPECS)


def build_vit(name: str, **overrides) -> VisionTransformer:
    """The named variant, with any constructor argument overridden."""
    if name not in VIT_SPECS:
        raise ValueError(f"unknown model {name!r}; expected one of: {', '.join(list_vit_models())}")
    return VisionTransformer(**{**VIT_SPECS[name], **overrides})


def vit_ti16(**overrides) -> VisionTransformer:
    """ViT-Ti/16 (DeiT-Tiny): 12 blocks of width 192, 3 heads, MLP 768; 5.7 M params with the
    defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_ti16", **overrides)


def vit_s16(**overrides) -> VisionTransformer:
    """ViT-S/16 (DeiT-Small): 12 blocks of width 384, 6 heads, MLP 1536; 22 M params with the
    defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_s16", **overrides)


def vit_b16(**overrides) -> VisionTransformer:
    """ViT-B/16: 12 blocks of width 768, 12 heads, MLP 3072; 86.6 M params with the
    defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_b16", **overrides)


def vit_b32(**overrides) -> VisionTransformer:
    """ViT-B/32: ViT-B with 32 px patches; 88.2 M params with the
    defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_b32", **overrides)


def vit_l16(**overrides) -> VisionTransformer:
    """ViT-L/16: 24 blocks of width 1024, 16 heads, MLP 4096; 304 M params with the
    defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_l16", **overrides)


def vit_h16(**overrides) -> VisionTransformer:
    """ViT-H/16: 32 blocks of width 1280, 16 heads, MLP 5120; 632 M params with the
    defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_h16", **overrides)


def vit_h14(**overrides) -> VisionTransformer:
    """ViT-H/14: ViT-H with 14 px patches; 632 M params with the
    defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_h14", **overrides)


def vit_g14(**overrides) -> VisionTransformer:
    """ViT-g/14 ("giant", Zhai et al. 2022): 40 blocks of width 1408, 16 heads, MLP 6144; 1011 M
    params without class token and head (the paper's count), 1013 M with the defaults (224 px,
    1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_g14", **overrides)


def vit_bigg14(**overrides) -> VisionTransformer:
    """ViT-G/14 ("bigG", Zhai et al. 2022): 48 blocks of width 1664, 16 heads, MLP 8192; 1843 M
    params without class token and head (the paper's count), 1844 M with the defaults (224 px,
    1000 classes, class token); ``overrides``: VisionTransformer arguments."""
    return build_vit("vit_bigg14", **overrides)


def vit_22b14(**overrides) -> VisionTransformer:
    """ViT-22B's shape (Dehghani et al. 2023): 48 blocks of width 6144, 48 heads, MLP 24576, 14 px
    patches, on the standard block (sequential attention and MLP, biases, no QK norm): 21.75 B
    params without class token and head, where ViT-22B's own block has 21.743 B, and 21.76 B
    with the defaults (224 px, 1000 classes, class token); ``overrides``: VisionTransformer
    arguments."""
    return build_vit("vit_22b14", **overrides)


def deit3_s16(**overrides) -> VisionTransformer:
    """DeiT III-S/16: ViT-S/16's sizes with LayerScale initialised to 1e-6 on both branches of
    every block (timm's deit3_small_patch16_224);
    22.1 M params with the defaults (224 px, 1000 classes, class token). timm's DeiT III keeps
    no position rows for the class token (no_embed_class); pycls's row for it adds to the
    learned token, the same model, and from_timm reads timm's weights into it exactly."""
    return build_vit("deit3_s16", **overrides)


def deit3_b16(**overrides) -> VisionTransformer:
    """DeiT III-B/16: ViT-B/16's sizes with LayerScale at 1e-6 (timm's deit3_base_patch16_224);
    86.6 M params with the defaults (224 px, 1000 classes, class token); ``overrides``:
    VisionTransformer arguments. See ``deit3_s16``."""
    return build_vit("deit3_b16", **overrides)


def deit3_l16(**overrides) -> VisionTransformer:
    """DeiT III-L/16: ViT-L/16's sizes with LayerScale at 1e-6 (timm's deit3_large_patch16_224);
    304.4 M params with the defaults (224 px, 1000 classes, class token); ``overrides``:
    VisionTransformer arguments. See ``deit3_s16``."""
    return build_vit("deit3_l16", **overrides)


def deit3_h14(**overrides) -> VisionTransformer:
    """DeiT III-H/14: ViT-H/14's sizes with LayerScale at 1e-6 (timm's deit3_huge_patch14_224);
    632.1 M params with the defaults (224 px, 1000 classes, class token); ``overrides``:
    VisionTransformer arguments. See ``deit3_s16``."""
    return build_vit("deit3_h14", **overrides)
