"""The Vision Transformer: the model (``transformer``) and its import from torchvision and timm
(``from_libraries``), all importable from here (``from pycls.models.vit import from_timm``)."""

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "from_libraries": [
            "from_timm",
            "from_torchvision",
        ],
        "position": [
            "resample_pos_embed",
        ],
        "transformer": [
            "CLASSIFIERS",
            "FFNS",
            "LAYOUTS",
            "POS_EMBEDS",
            "STEMS",
            "VisionTransformer",
        ],
    },
)
