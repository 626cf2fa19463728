"""The loader's settings: how the DataLoader of every split runs its workers, and what a training
epoch's shuffle buffer and a corrupt sample are to it; each declared once (``pycls.options``)
with its default, its meaning and its values. The config's DATA_LOADER keys of these settings are
generated from the fields (``pycls.config.sections.data``), and ``construct_loader`` takes them
as keyword arguments. Plain Python, no torch: the config reads the declarations.
"""

from dataclasses import asdict, dataclass

from pycls.options import option


@dataclass(frozen=True)
class LoaderSettings:
    """Keyword arguments of ``pycls.datasets.loading.loader.construct_loader`` that a run's
    config gives (``kwargs()``); the rest (the batch, the seed, the order) the builders work out
    per split."""

    num_workers: int = option(
        4,
        "Worker processes per training process (0 loads in the main process); a count above the "
        "CPUs this machine gives each training process runs as that many, said in a note (the "
        "machine step)",
        bounds="non_negative",
    )
    pin_memory: bool = option(
        True, "Page-locked host memory for faster, asynchronous host-to-device copies"
    )
    persistent_workers: bool = option(True, "Keep workers alive between epochs")
    prefetch_factor: int = option(4, "Batches each worker prepares ahead", bounds="positive")
    skip_corrupt: bool = option(
        False,
        "Skip (and count) unreadable or corrupt images instead of stopping with an error",
        feature="skip corrupt",
    )
    shuffle_buffer: int = option(
        8192,
        "Samples in the shuffle buffer of ORDER shards / resampled (a sample leaves at most this "
        "many places early; WebDataset and timm use 8192). At most the samples whose epoch order "
        "this machine's memory holds (8 bytes each): a larger buffer is larger than any split "
        "(checked where the run runs: pycls.config.machine)",
        bounds="non_negative",
    )

    def kwargs(self) -> dict:
        """The settings as ``construct_loader``'s keyword arguments."""
        return asdict(self)


# The CPU loader's augmentation presets (TRAIN.AUGMENT, beside its 'default'): built by
# ``pycls.datasets.loading.transforms``; named here, without torch, for the config's checks
PRESETS = (
    "imagenet",
    "cifar",
    "digits",
    "none",
    "deit",
    "plain_vit",
    "big_vision",
    "three_augment",
    "three_augment_src",
    "deit3_finetune",
)
