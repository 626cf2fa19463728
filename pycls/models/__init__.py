"""Models: the Vision Transformer (``vit/``), upstream pycls's CNN families (``cnn/``: AnyNet,
RegNet, ResNet/ResNeXt, EfficientNet), their named variants (the zoo), their analytic complexity
and parameter groups. ``anynet``, ``regnet``, ``resnet`` and ``effnet`` here are re-export shims
at upstream pycls's paths.

Nothing here imports ``pycls.core``: models take explicit arguments, and the builders that
read the config live on the core side.

``list_models()`` and ``build_model(name, pretrained=False, num_classes=None)`` cover the whole
zoo (the CNNs by upstream's names, "RegNetY-800MF", and the ViTs, "vit_b16");
``pycls.models.vit.variants.list_vit_models()`` lists the ViT variants only.
"""

from typing import TYPE_CHECKING

from pycls.package_faces import install_face

# The face (pycls.package_faces): each name imports its module on first use, so that the config's
# torch-free reads of vit.args, cnn.cnn_args, cnn.zoo_table and layer_ids cost no torch
if TYPE_CHECKING:
    from pycls.models.cnn.anynet import AnyNet, anynet_complexity
    from pycls.models.cnn.effnet import EffNet, effnet_complexity
    from pycls.models.cnn.regnet import RegNet, regnet_complexity
    from pycls.models.cnn.resnet import ResNet, resnet_complexity
    from pycls.models.vit import VisionTransformer, VitArgs, from_torchvision, resample_pos_embed
    from pycls.models.vit.complexity import vit_complexity
    from pycls.models.vit.variants import (
        VIT_SPECS,
        build_vit,
        deit3_b16,
        deit3_h14,
        deit3_l16,
        deit3_s16,
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

install_face(__name__)
