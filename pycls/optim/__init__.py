"""Optimizers and what they step: torch's fused SGD / AdamW kernels and LAMB on the same AdamW
kernel (``optimizers``), the weight-decay and layer-decay parameter groups built from the model,
and the flat buffers of the contiguous mode (``flat_buffers``). Plain arguments only: the
builders (``pycls.core.builders.build_optimizer``) turn the config's OPTIM keys into
``OptimizerSettings``.
"""

from pycls.optim.optimizers import (
    LAMB,
    SGD,
    AdamW,
    OptimizerSettings,
    no_weight_decay_names,
    optimizer_from_settings,
    param_groups,
)

__all__ = [
    "LAMB",
    "SGD",
    "AdamW",
    "OptimizerSettings",
    "no_weight_decay_names",
    "optimizer_from_settings",
    "param_groups",
]
