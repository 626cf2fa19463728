"""Models: the Vision Transformer, upstream pycls's CNN families (AnyNet, RegNet, ResNet/ResNeXt,
EfficientNet), their named variants (the zoo), their analytic complexity and parameter groups.

Nothing here imports ``pycls.core``: models take explicit arguments, and the builders that
read the config live on the core side.

``list_models()`` and ``build_model(name, pretrained=False, num_classes=None)`` cover the whole
zoo (the CNNs by upstream's names, "RegNetY-800MF", and the ViTs, "vit_b16");
``pycls.models.vit.variants.list_vit_models()`` lists the ViT variants only.
"""

from pycls.models.anynet import AnyNet, anynet_complexity
from pycls.models.effnet import EffNet, effnet_complexity
from pycls.models.regnet import RegNet, regnet_complexity
from pycls.models.resnet import ResNet, resnet_complexity
from pycls.models.vit import VisionTransformer, from_torchvision, resample_pos_embed
from pycls.models.vit.complexity import vit_complexity
from pycls.models.vit.variants import (
    VIT_SPECS,
    build_vit,
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
from pycls.models.zoo import (
    ZOO,
    PretrainedWeightsUnavailable,
    build_model,
    effnet,
    list_models,
    regnetx,
    regnety,
    resnet,
    resnext,
)

__all__ = [
    "ZOO",
    "VIT_SPECS",
    "AnyNet",
    "EffNet",
    "PretrainedWeightsUnavailable",
    "RegNet",
    "ResNet",
    "VisionTransformer",
    "anynet_complexity",
    "build_model",
    "build_vit",
    "effnet",
    "effnet_complexity",
    "from_torchvision",
    "list_models",
    "regnet_complexity",
    "regnetx",
    "regnety",
    "resample_pos_embed",
    "resnet",
    "resnet_complexity",
    "resnext",
    "vit_22b14",
    "vit_b16",
    "vit_b32",
    "vit_bigg14",
    "vit_complexity",
    "vit_g14",
    "vit_h14",
    "vit_h16",
    "vit_l16",
    "vit_s16",
    "vit_ti16",
]
