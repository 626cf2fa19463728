"""The Vision Transformer's one home, every name importable from here (``from pycls.models.vit
import VisionTransformer, from_timm``):

- ``args``: its one argument list (``VitArgs``: every argument, default, meaning and check; the
  named variants' sizes), plain Python;
- ``transformer``: the model; ``blocks``: attention, MLP, local feed-forward, drop-path, stems;
  ``position``: the position embedding; ``token_masks``: patch dropout, drop-path skip, token
  batches;
- ``complexity``: analytic FLOPs, parameters and activations of a ``VitArgs``;
- ``variants``: the named variants (``vit_ti16`` ... ``vit_22b14``);
- ``from_libraries``: ``from_torchvision``, ``from_timm``;
- ``parallel_plan``: how the engines cut it (``pipeline_cut``, ``tensor_plan``).
"""

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
            "VisionTransformer",
        ],
        "args": [
            "CLASSIFIERS",
            "FFNS",
            "LAYOUTS",
            "POS_EMBEDS",
            "RESIDUAL_DTYPES",
            "STEMS",
            "VitArgs",
        ],
    },
)
