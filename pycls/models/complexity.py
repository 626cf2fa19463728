"""Re-export shim: the ViT's analytic complexity now live in ``pycls.models.vit.complexity``, the
ViT's one home. This module re-exports their names so that ``pycls.models.complexity`` keeps
working."""

from pycls.models.vit.complexity import (
    UNCOUNTED,
    encoder_block_flops,
    vit_complexity,
    vit_run_flops,
)

__all__ = [
    "UNCOUNTED",
    "encoder_block_flops",
    "vit_complexity",
    "vit_run_flops",
]
