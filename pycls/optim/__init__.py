"""Optimizers and what they step: torch's fused SGD / AdamW kernels, LAMB on the same AdamW
kernel and Muon beside it (``optimizers``; Muon's matrix update in ``muon``), the weight-decay
and layer-decay parameter groups built from the model and the settings that build an optimizer
(``optimizer_settings``), the flat buffers of the contiguous mode (``flat_buffers``) and AdamW as
one compiled pass over them (``one_pass``). Plain arguments only: the builders
(``pycls.core.builders.build_optimizer``) turn the config's OPTIM and MUON keys into
``OptimizerSettings``. The face loads each module on first use (``pycls.package_faces``), so that
the Newton-Schulz bound the config checks (``newton_schulz``) costs no torch.
"""

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "one_pass": ["OnePassAdamW"],
        "optimizer_settings": [
            "OptimizerSettings",
            "no_weight_decay_names",
            "optimizer_from_settings",
            "param_groups",
        ],
        "optimizers": ["LAMB", "SGD", "AdamW", "Muon"],
    },
)
