"""Re-export shim, kept because users import from it (as in upstream pycls): the optimizers live
in ``pycls.optim``; ``construct_optimizer(cfg, model)`` is ``pycls.core.builders.build_optimizer``,
the builder that reads the config's OPTIM keys."""

from pycls.core.builders import build_optimizer as construct_optimizer
from pycls.optim import (  # noqa: F401  (re-exported)
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
    "construct_optimizer",
    "no_weight_decay_names",
    "optimizer_from_settings",
    "param_groups",
]
