"""Re-export shim: ``OptimizerSettings`` and ``optimizer_from_settings`` (the optimizer a plain
description asks for, one-pass AdamW included) live in ``pycls.optim.optimizer_settings``, beside
the parameter groups they build over. This module re-exports their names so that
``pycls.optim.factory`` keeps working."""

from pycls.optim.optimizer_settings import OPTIMIZERS, OptimizerSettings, optimizer_from_settings

__all__ = ["OPTIMIZERS", "OptimizerSettings", "optimizer_from_settings"]
