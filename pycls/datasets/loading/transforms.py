"""Augmentation presets on uint8 CHW image tensors (torchvision.transforms.v2).

The datasets return raw uint8 images; these transforms run per sample in the loader workers and
also return uint8, so that what crosses the process boundary (and later the host-to-device copy)
stays four times smaller than float. Conversion to float and normalisation happen on the device
(see ``loader.DeviceBatches``).

All randomness comes from torch's global RNG, which ``loader.AugmentedDataset`` seeds per sample.
"""

import math
from collections.abc import Callable

import torch
from torchvision import transforms as v1
from torchvision.transforms import v2

from pycls.datasets.loading.loader_settings import PRESETS
from pycls.datasets.loading.timm_augment import DEIT_RAND_AUGMENT, TimmRandAugment

AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")

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


def _deit(image_size: int, train: bool) -> list[Callable]:
    """DeiT (Touvron et al., 2021): random-resized crop, flip, RandAugment 2/9, erasing 0.25."""
    if not train:
        return _imagenet(image_size, train)
    return [*_imagenet(image_size, train), v2.RandAugment(2, 9), RandomErasing(0.25)]


def _plain_vit(image_size: int, train: bool) -> list[Callable]:
    """ "Better plain ViT baselines" (Beyer et al., 2022): inception crop (scale 5-100 %), flip,
    RandAugment 2/10."""
    if not train:
        return _imagenet(image_size, train)
    return [
        v2.RandomResizedCrop(image_size, scale=(0.05, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandAugment(2, 10),
    ]


def _big_vision(image_size: int, train: bool) -> list[Callable]:
    """big_vision's configs/vit_s16_i1k.py (google-research/big_vision at 0127fb6): its
    ``decode_jpeg_and_inception_crop`` (5-100 % of the area, aspect ratio 0.75-1.33, bilinear
    without antialiasing), ``flip_lr`` and ``randaug(2, 10)``, whose magnitude 10 is the TF
    RandAugment's largest (``_MAX_LEVEL``): torchvision's RandAugment with 11 magnitude bins at
    bin 10, the geometric operations filling with grey 128 as TF's ``replace`` does. Evaluation:
    ``resize_small(256)|central_crop(224)``, the imagenet preset's."""
    if not train:
        return _imagenet(image_size, train)
    return [
        v2.RandomResizedCrop(
            image_size,
            scale=(0.05, 1.0),
            ratio=(0.75, 1.33),
            interpolation=v2.InterpolationMode.BILINEAR,
            antialias=False,
        ),
        v2.RandomHorizontalFlip(),
        v2.RandAugment(num_ops=2, magnitude=10, num_magnitude_bins=11, fill=128),
    ]


# DeiT III's 3-Augment (facebookresearch/deit at 7e160fe, augment.py new_data_aug_generator):
# after the crop and flip, one of grayscale, solarization and Gaussian blur, with equal chance,
# then colour jitter of its recipe's --color-jitter 0.3 (brightness, contrast, saturation)
THREE_AUGMENT_JITTER = 0.3
# PIL's GaussianBlur radius (its standard deviation), drawn uniformly from this range
THREE_AUGMENT_BLUR_SIGMA = (0.1, 2.0)


def _three_augment_ops() -> list[Callable]:
    sigma = THREE_AUGMENT_BLUR_SIGMA
    kernel = 2 * math.ceil(3 * sigma[1]) + 1  # +-3 standard deviations of the widest blur
    one_of = v2.RandomChoice(
        [v2.Grayscale(3), v2.RandomSolarize(128, p=1.0), v2.GaussianBlur(kernel, sigma=sigma)]
    )
    jitter = THREE_AUGMENT_JITTER
    return [one_of, v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter)]


def _three_augment(image_size: int, train: bool) -> list[Callable]:
    """DeiT III's ImageNet-1k augmentation (--ThreeAugment): random-resized crop (8-100 %,
    bicubic), flip, 3-Augment. Evaluation as its recipes: the shorter side to the size (bicubic,
    --eval-crop-ratio 1.0), the centre crop."""
    if not train:
        return _full_crop_eval(image_size)
    bicubic = v2.InterpolationMode.BICUBIC
    crop = v2.RandomResizedCrop(image_size, scale=(0.08, 1.0), interpolation=bicubic)
    return [crop, v2.RandomHorizontalFlip(), *_three_augment_ops()]


def _three_augment_src(image_size: int, train: bool) -> list[Callable]:
    """DeiT III's simple random crop with 3-Augment (--ThreeAugment --src, its ImageNet-21k
    recipe): the shorter side resized to the size (bicubic), a random crop of the size from the
    image padded by 4 px (reflected), flip, 3-Augment. Evaluation as three_augment."""
    if not train:
        return _full_crop_eval(image_size)
    return [
        v2.Resize(image_size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
        v2.RandomCrop(image_size, padding=4, padding_mode="reflect"),
        v2.RandomHorizontalFlip(),
        *_three_augment_ops(),
    ]


def _deit3_finetune(image_size: int, train: bool) -> list[Callable]:
    """DeiT III's fine-tuning augmentation (README_revenge.md's fine-tuning commands: ``--aa
    rand-m9-mstd0.5-inc1 --reprob 0.0``, no ``--ThreeAugment``, so DeiT's datasets.py builds timm's
    create_transform): random-resized crop (8-100 %, bicubic), flip, timm's RandAugment
    rand-m9-mstd0.5-inc1; no colour jitter (timm leaves it out beside RandAugment) and no random
    erasing. Evaluation as three_augment (--eval-crop-ratio 1.0)."""
    if not train:
        return _full_crop_eval(image_size)
    bicubic = v2.InterpolationMode.BICUBIC
    return [
        v2.RandomResizedCrop(image_size, scale=(0.08, 1.0), interpolation=bicubic),
        v2.RandomHorizontalFlip(),
        TimmRandAugment(DEIT_RAND_AUGMENT, image_size),
    ]


def _full_crop_eval(image_size: int) -> list[Callable]:
    bicubic = v2.InterpolationMode.BICUBIC
    return [v2.Resize(image_size, interpolation=bicubic, antialias=True), v2.CenterCrop(image_size)]


_BUILDERS = {
    "imagenet": _imagenet,
    "cifar": _cifar,
    "digits": _digits,
    "none": _none,
    "deit": _deit,
    "plain_vit": _plain_vit,
    "big_vision": _big_vision,
    "three_augment": _three_augment,
    "three_augment_src": _three_augment_src,
    "deit3_finetune": _deit3_finetune,
}


class RandomErasing:
    """Random erasing (Zhong et al., 2020) on uint8 images: a box of random pixel values.

    torchvision samples the box; the fill is uniform random bytes, the uint8 counterpart of the
    per-pixel normal noise used on normalised images.
    """

    def __init__(self, p: float, scale=(0.02, 1 / 3), ratio=(0.3, 3.3)):
        self.p, self.scale, self.ratio = p, scale, ratio

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.p <= 0 or torch.rand(()) >= self.p:
            return image
        i, j, h, w, _ = v1.RandomErasing.get_params(
            image, scale=self.scale, ratio=self.ratio, value=[0]
        )
        image = image.clone()
        image[..., i : i + h, j : j + w] = torch.randint(
            0, 256, (image.shape[0], h, w), dtype=image.dtype
        )
        return image

    def __repr__(self) -> str:
        return f"RandomErasing(p={self.p})"


def _auto_augment(name: str, n: int, m: int) -> list[Callable]:
    if name == "randaugment":
        return [v2.RandAugment(num_ops=n, magnitude=m)]
    if name == "trivialaugment":
        return [v2.TrivialAugmentWide()]
    if name == "autoaugment":
        return [v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)]
    return []


def build_transform(
    preset: str,
    image_size: int,
    train: bool,
    *,
    auto_augment: str = "none",
    rand_augment_n: int = 2,
    rand_augment_m: int = 9,
    random_erasing: float = 0.0,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return a callable mapping a uint8 (3, H, W) tensor to a uint8 (3, image_size, image_size).

    Training adds ``auto_augment`` (after the preset's crop and flip) and random erasing (last).
    """
    if preset not in _BUILDERS:
        raise ValueError(f"unknown augmentation preset {preset!r}; expected one of {PRESETS}")
    if auto_augment not in AUTO_AUGMENTS:
        raise ValueError(f"unknown auto augment {auto_augment!r}; expected one of {AUTO_AUGMENTS}")
    if image_size <= 0:
        raise ValueError(f"image_size must be positive, got {image_size}")
    steps = _BUILDERS[preset](image_size, train)
    if train:
        steps += _auto_augment(auto_augment, rand_augment_n, rand_augment_m)
        if random_erasing > 0:
            steps.append(RandomErasing(random_erasing))
    return v2.Compose(steps)


# How each preset evaluates, in timm's terms: the shorter side resized to size / crop_pct, then
# the centre crop ("center"); or the image resized to the square ("squash", crop_pct 1); and the
# interpolation
_EVAL_CROPS = {
    "imagenet": ("center", _EVAL_CROP_RATIO, "bilinear"),
    "deit": ("center", _EVAL_CROP_RATIO, "bilinear"),
    "plain_vit": ("center", _EVAL_CROP_RATIO, "bilinear"),
    "big_vision": ("center", _EVAL_CROP_RATIO, "bilinear"),
    "three_augment": ("center", 1.0, "bicubic"),
    "three_augment_src": ("center", 1.0, "bicubic"),
    "deit3_finetune": ("center", 1.0, "bicubic"),
    "cifar": ("squash", 1.0, "bilinear"),
    "digits": ("squash", 1.0, "bilinear"),
    "none": ("squash", 1.0, "bilinear"),
}


def eval_data_config(preset: str, image_size: int) -> dict:
    """The evaluation transform of ``preset`` at ``image_size`` as timm's pretrained config
    spells it (``input_size``, ``interpolation``, ``crop_pct``, ``crop_mode``): what
    ``timm.data.resolve_data_config`` gives back to evaluate an exported model as pycls does."""
    if preset not in _EVAL_CROPS:
        raise ValueError(f"unknown augmentation preset {preset!r}; expected one of {PRESETS}")
    mode, crop_pct, interpolation = _EVAL_CROPS[preset]
    return {
        "input_size": (3, image_size, image_size),
        "interpolation": interpolation,  # antialiased, as torchvision's Resize
        "crop_pct": crop_pct,
        "crop_mode": mode,
    }


class BatchMixer:
    """Mixup / CutMix on a device batch (torchvision.transforms.v2.MixUp and CutMix).

    A batch is mixed with probability ``prob``; when both are enabled, CutMix is chosen with
    probability ``switch_prob``. Mixing stops from ``off_epoch`` on (0: never stops). Returns the
    mixed images and soft targets; the caller keeps the hard labels for the error meters.
    Randomness comes from torch's global RNG, which checkpoints save and restore.
    """

    def __init__(
        self,
        num_classes,
        *,
        mixup_alpha=0.0,
        cutmix_alpha=0.0,
        prob=1.0,
        switch_prob=0.5,
        off_epoch=0,
    ):
        self.mixup = v2.MixUp(alpha=mixup_alpha, num_classes=num_classes) if mixup_alpha else None
        self.cutmix = (
            v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes) if cutmix_alpha else None
        )
        self.prob, self.switch_prob, self.off_epoch = prob, switch_prob, off_epoch

    @property
    def enabled(self) -> bool:
        return self.mixup is not None or self.cutmix is not None

    def active(self, epoch: int) -> bool:
        return self.enabled and (self.off_epoch <= 0 or epoch < self.off_epoch)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor):
        if torch.rand(()) >= self.prob:
            return images, labels
        use_cutmix = self.mixup is None or (
            self.cutmix is not None and torch.rand(()) < self.switch_prob
        )
        return (self.cutmix if use_cutmix else self.mixup)(images, labels)
