"""Re-export shim: ``pycls.datasets.transforms`` is upstream pycls's path of the augmentations;
the presets now live in ``pycls.datasets.loading.transforms`` (the room of what turns samples
into batches). This module re-exports their public names so that ``from
pycls.datasets.transforms import build_transform`` keeps working."""

from pycls.datasets.loading.transforms import (
    AUTO_AUGMENTS,
    PRESETS,
    BatchMixer,
    RandomErasing,
    build_transform,
    eval_data_config,
)

__all__ = [
    "AUTO_AUGMENTS",
    "PRESETS",
    "BatchMixer",
    "RandomErasing",
    "build_transform",
    "eval_data_config",
]
