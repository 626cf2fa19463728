"""Models: the Vision Transformer, upstream pycls's CNN families (AnyNet, RegNet, ResNet/ResNeXt,
EfficientNet), their named variants (the zoo), their analytic complexity and parameter groups.

Nothing here imports ``pycls.core``: models take explicit arguments, and the builders that
read the config live on the core side.

``list_models()`` and ``build_model(name, pretrained=False, num_classes=None)`` cover the whole
zoo (the CNNs by upstream's names, "RegNetY-800MF", and the ViTs, "vit_b16");
``pycls.models.vit.variants.list_vit_models()`` lists the ViT variants only.
"""

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "cnn.anynet": [
            "AnyNet",
            "anynet_complexity",
        ],
        "cnn.effnet": [
            "EffNet",
            "effnet_complexity",
        ],
        "cnn.regnet": [
            "RegNet",
            "regnet_complexity",
        ],
        "cnn.resnet": [
            "ResNet",
            "resnet_complexity",
        ],
        "vit": [
            "VisionTransformer",
            "VitArgs",
            "from_torchvision",
            "resample_pos_embed",
        ],
        "vit.complexity": [
            "vit_complexity",
        ],
        "vit.variants": [
            "VIT_SPECS",
            "build_vit",
            "deit3_b16",
            "deit3_h14",
            "deit3_l16",
            "deit3_s16",
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
        ],
        "zoo": [
            "ZOO",
            "PretrainedWeightsUnavailable",
            "build_model",
            "effnet",
            "list_models",
            "regnetx",
            "regnety",
            "resnet",
            "resnext",
        ],
    },
)
