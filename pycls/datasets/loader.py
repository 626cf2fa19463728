"""Re-export shim: ``pycls.datasets.loader`` is upstream pycls's path of the data loader; the
loader now lives in ``pycls.datasets.loading.loader`` (the room of what turns samples into
batches). This module re-exports its public names so that ``from pycls.datasets.loader import
construct_loader`` keeps working."""

from pycls.datasets.loading.loader import (
    AugmentedDataset,
    DeviceBatches,
    SeededSampler,
    collate_skipping,
    construct_loader,
    loader_batches,
    sample_seed,
    worker_init_fn,
)

__all__ = [
    "AugmentedDataset",
    "DeviceBatches",
    "SeededSampler",
    "collate_skipping",
    "construct_loader",
    "loader_batches",
    "sample_seed",
    "worker_init_fn",
]
