"""Re-export shim: the ViT's tensor- and sequence-parallel plan now live in
``pycls.models.vit.tensor_plan``, the ViT's one home. This module re-exports their names so that
``pycls.engines.tensor_plan`` keeps working."""

from pycls.models.vit.args import check_vit_split, tp_divisors
from pycls.models.vit.tensor_plan import (
    ChannelParallelDepthwise,
    GroupDropPath,
    LocalDropout,
    QKVLayout,
    parallelize_vit,
    replicated_parameter_names,
)

__all__ = [
    "ChannelParallelDepthwise",
    "GroupDropPath",
    "LocalDropout",
    "QKVLayout",
    "check_vit_split",
    "parallelize_vit",
    "replicated_parameter_names",
    "tp_divisors",
]
