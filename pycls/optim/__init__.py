"""Optimizers and what they step: torch's fused SGD / AdamW kernels, LAMB on the same AdamW
kernel and Muon beside it (``optimizers``; Muon's matrix update in ``muon``), the weight-decay
and layer-decay parameter groups built from the model and the settings that build an optimizer
(``optimizer_settings``; the settings record, whose fields the OPTIM and MUON keys are generated
from, in ``optimizer_options``), the flat buffers of the contiguous mode (``flat_buffers``) and
AdamW as one compiled pass over them (``one_pass``). Plain arguments only: the builders
(``pycls.core.builders.build_optimizer``) turn the config's OPTIM and MUON keys into
``OptimizerSettings``. The face loads each module on first use (``pycls.package_faces``), so that
the Newton-Schulz bound the config checks (``newton_schulz``) costs no torch.
"""

from typing import TYPE_CHECKING

from pycls.package_faces import install_face

# The face (pycls.package_faces): each name imports its module on first use, so that the config's
# torch-free reads of newton_schulz, library_names and optimizer_options cost no torch
if TYPE_CHECKING:
    from pycls.optim.one_pass import OnePassAdamW
    from pycls.optim.optimizer_options import OptimizerSettings
    from pycls.optim.optimizer_settings import (
        no_weight_decay_names,
        optimizer_from_settings,
        param_groups,
    )
    from pycls.optim.optimizers import LAMB, SGD, AdamW, Muon

install_face(__name__)
