"""The data sets by name (TRAIN.DATASET, TEST.DATASET): how each is built, its normalisation
statistics and the augmentation preset that suits it."""

import os

from torch.utils.data import Dataset

from pycls.datasets.formats.cifar import Cifar
from pycls.datasets.formats.digits import Digits
from pycls.datasets.formats.image_header import DEFAULT_MAX_PIXELS
from pycls.datasets.formats.imagefolder import ImageFolder
from pycls.datasets.formats.synthetic import Synthetic


# Every factory takes the same keyword arguments and ignores those it does not need, so the
# builder can call any of them the same way.
def _digits(*, root, split, image_size, num_samples, num_classes, max_pixels) -> Dataset:
    return Digits(split)


def _cifar10(*, root, split, image_size, num_samples, num_classes, max_pixels) -> Dataset:
    return Cifar(root, split, num_classes=10)


def _cifar100(*, root, split, image_size, num_samples, num_classes, max_pixels) -> Dataset:
    return Cifar(root, split, num_classes=100)


def _imagefolder(*, root, split, image_size, num_samples, num_classes, max_pixels) -> Dataset:
    return ImageFolder(root, split, max_pixels)


def _synthetic(*, root, split, image_size, num_samples, num_classes, max_pixels) -> Dataset:
    # A different seed per split so that "test" images are not the training images.
    seed = 0 if split == "train" else 1
    return Synthetic(num_samples, image_size, num_classes, seed=seed)


DATASETS = {
    "digits": _digits,
    "cifar10": _cifar10,
    "cifar100": _cifar100,
    "imagefolder": _imagefolder,
    "synthetic": _synthetic,
}

_IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

# Per-channel (mean, std) in 0-1 units, for DeviceBatches.
DATASET_STATS = {
    # Training split, 8x8 pixels after scaling 0..16 to 0..255, population std:
    #   x = Digits("train").images.double() / 255; x.mean(), x.std(unbiased=False)
    # All three channels are the same grey image.
    "digits": ((0.3058,) * 3, (0.3764,) * 3),
    # Training split, per channel, population std (the widely quoted 0.2023-style values are
    # an average of per-image stds, not the dataset std).
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": _IMAGENET_STATS,
    # Random images: the statistics do not matter; ImageNet's keep the arithmetic representative.
    "synthetic": _IMAGENET_STATS,
}

# Augmentation preset (transforms.PRESETS) that suits each dataset.
DEFAULT_AUGMENT = {
    "digits": "digits",
    "cifar10": "cifar",
    "cifar100": "cifar",
    "imagefolder": "imagenet",
    "synthetic": "none",
}


def build_dataset(
    name: str,
    *,
    split: str,
    root: str | os.PathLike = "",
    image_size: int = 224,
    num_samples: int = 50_000,
    num_classes: int = 1000,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Dataset:
    """Build a raw dataset by name. ``root`` is used by cifar10/100 and imagefolder;
    ``image_size``, ``num_samples`` and ``num_classes`` only by synthetic; ``max_pixels`` (the
    most pixels a decoded image may declare) by imagefolder."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {sorted(DATASETS)}")
    return DATASETS[name](
        root=root,
        split=split,
        image_size=image_size,
        num_samples=num_samples,
        num_classes=num_classes,
        max_pixels=max_pixels,
    )
