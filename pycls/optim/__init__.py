"""Optimizers and what they step: torch's fused SGD / AdamW kernels, LAMB on the same AdamW
kernel and Muon beside it (``optimizers``; Muon's matrix update in ``muon``), the weight-decay
and layer-decay parameter groups built from the model and the settings that build an optimizer
(``optimizer_settings``), the flat buffers of the contiguous mode (``flat_buffers``) and AdamW as
one compiled pass over them (``one_pass``). Plain arguments only: the builders
(``pycls.core.builders.build_optimizer``) turn the config's OPTIM and MUON keys into
``OptimizerSettings``.
"""

from pycls.optim.one_pass import OnePassAdamW
from pycls.optim.optimizer_settings import (
    OptimizerSettings,
    no_weight_decay_names,
    optimizer_from_settings,
    param_groups,
)
from pycls.optim.optimizers import LAMB, SGD, AdamW, Muon

__all__ = [
    "LAMB",
    "SGD",
    "AdamW",
    "Muon",
    "OnePassAdamW",
    "OptimizerSettings",
    "no_weight_decay_names",
    "optimizer_from_settings",
    "param_groups",
]
