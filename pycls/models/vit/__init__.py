"""The Vision Transformer's one home, every name importable from here (``from pycls.models.vit
import VisionTransformer, from_timm``):

- ``args``: its one argument list (``VitArgs``: every argument, default, meaning and check; the
  named variants' sizes), plain Python; ``arg_checks``: what holds between the arguments;
- ``transformer``: the model; ``blocks``: the sequential and parallel blocks, drop-path, with their
  parts in ``attention``, ``feed_forward``, ``norms``, ``rotary`` (2-D RoPE) and ``stems``;
  ``attention_pool``: the MAP head; ``position``: the position embedding; ``token_masks``: patch
  dropout, drop-path skip, token batches;
- ``complexity``: analytic FLOPs, parameters and activations of a ``VitArgs``;
- ``variants``: the named variants (``vit_ti16`` ... ``vit_22b14``, ``deit3_s16`` ...);
- ``from_libraries``: ``from_torchvision``, ``from_timm`` (timm's models read by
  ``timm_import``; the timm class an export writes chosen by ``timm_export``);
- ``parallel_plan``: how the engines cut it (``pipeline_cut``, ``tensor_plan`` with its layers in
  ``tensor_layers`` and the fused projections' order in ``fused_layout``).
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
            "BLOCKS",
            "CLASSIFIERS",
            "DROP_PATH_SCHEDULES",
            "FFNS",
            "LAYOUTS",
            "NORM_LAYERS",
            "POS_EMBEDS",
            "QK_NORMS",
            "RESIDUAL_DTYPES",
            "ROPES",
            "STEMS",
            "VitArgs",
        ],
    },
)
