"""Augmentation presets on uint8 CHW image tensors (torchvision.transforms.v2).

The datasets return raw uint8 images; these transforms run per sample in the loader workers and
also return uint8, so that what crosses the process boundary (and later the host-to-device copy)
stays four times smaller than float. Conversion to float and normalisation happen on the device
(see ``loader.DeviceBatches``).

All randomness comes from torch's global RNG, which ``loader.AugmentedDataset`` seeds per sample.
"""

from collections.abc import Callable

import torch
from torchvision.transforms import v2

PRESETS = ("imagenet", "cifar", "digits", "none")

# Eval-time resize ratio of the classic ImageNet protocol: resize to 256, centre crop 224.
_EVAL_CROP_RATIO = 0.875


def _square_resize(image_size: int) -> v2.Resize:
    # A (size, size) target (not a shorter-edge size) so non-square inputs still come out square.
    # v2.Resize returns the input untouched when it already has the target size.
    return v2.Resize((image_size, image_size), antialias=True)


def _imagenet(image_size: int, train: bool) -> list[Callable]:
    if train:
        return [
            v2.RandomResizedCrop(image_size, scale=(0.08, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    return [
        v2.Resize(round(image_size / _EVAL_CROP_RATIO), antialias=True),
        v2.CenterCrop(image_size),
    ]


def _cifar(image_size: int, train: bool) -> list[Callable]:
    if not train:
        return [_square_resize(image_size)]
    # Resizing first (a no-op at the native 32 px) keeps the pad-and-crop jitter proportional to
    # the image size when training at a larger resolution.
    return [
        _square_resize(image_size),
        v2.RandomCrop(image_size, padding=image_size // 8, padding_mode="reflect"),
        v2.RandomHorizontalFlip(),
    ]


def _digits(image_size: int, train: bool) -> list[Callable]:
    if not train:
        return [_square_resize(image_size)]
    # No flips: a mirrored 2, 3, 5 or 7 is not the same digit. Small affine jitter instead; the
    # fill (0) matches the black background of the digit images.
    return [
        _square_resize(image_size),
        v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
    ]


def _none(image_size: int, train: bool) -> list[Callable]:
    return [_square_resize(image_size)]


_BUILDERS = {"imagenet": _imagenet, "cifar": _cifar, "digits": _digits, "none": _none}


def build_transform(
    preset: str, image_size: int, train: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return a callable mapping a uint8 (3, H, W) tensor to a uint8 (3, image_size, image_size)."""
    if preset not in _BUILDERS:
        raise ValueError(f"unknown augmentation preset {preset!r}; expected one of {PRESETS}")
    if image_size <= 0:
        raise ValueError(f"image_size must be positive, got {image_size}")
    return v2.Compose(_BUILDERS[preset](image_size, train))
