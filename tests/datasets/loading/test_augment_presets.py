"""The recipe presets of TRAIN.AUGMENT against their sources: DeiT III's 3-Augment and simple
random crop (three_augment, three_augment_src) against DeiT's definitions (facebookresearch/deit
at 7e160fe, augment.py ``new_data_aug_generator``), rebuilt here on PIL images as DeiT runs
them, by seeded statistics: how often each operation fires, the ranges of what comes out;
big_vision's (big_vision) parameters against its config; and DeiT III's fine-tuning augmentation
(deit3_finetune) against the timm pipeline DeiT builds, draw for draw."""

import random
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter, ImageOps
from torchvision import transforms as v1
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from pycls.config.sections import data
from pycls.datasets.loading import transforms

DRAWS = 600  # per statistic: a third is 200 +- 11.5 (one standard deviation)


def _band(count, p, n=DRAWS, sigmas=4.5):
    """Whether ``count`` of ``n`` draws is within ``sigmas`` standard deviations of ``n p``."""
    return abs(count - n * p) <= sigmas * (n * p * (1 - p)) ** 0.5


def _pil(image):
    return Image.fromarray(image.permute(1, 2, 0).numpy())


def _tensor(pil):
    return torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)


class _DeitBlur:
    """DeiT's GaussianBlur(p=1.0): PIL's blur of a radius drawn uniformly from [0.1, 2]."""

    def __call__(self, img):
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(0.1, 2.0)))


def deit_three_augment():
    """DeiT's secondary transforms: one of gray_scale(p=1), Solarization(p=1) (PIL's solarize
    at its default 128), GaussianBlur(p=1), then ColorJitter(0.3, 0.3, 0.3)."""
    choice = v1.RandomChoice([v1.Grayscale(3), ImageOps.solarize, _DeitBlur()])
    return v1.Compose([choice, v1.ColorJitter(0.3, 0.3, 0.3)])


def ours_three_augment():
    """The preset's same stage: what follows the crop and the flip."""
    return v2.Compose(transforms._three_augment_ops())


def checkerboard(size=32):
    """Red and black squares: solarized it is all black (255 and 0 both go to 0 or stay), gray
    it has equal channels, blurred it keeps red apart from green; colour jitter keeps each so."""
    image = torch.zeros(3, size, size, dtype=torch.uint8)
    image[0, ::2, ::2] = image[0, 1::2, 1::2] = 255
    return image


def which_operation(image):
    if not image.any():
        return "solarize"
    if torch.equal(image[0], image[1]) and torch.equal(image[1], image[2]):
        return "grayscale"
    return "blur"


def test_three_augment_picks_each_operation_a_third_of_the_time_as_deit_does():
    """Caught: a RandomChoice with one operation left out (grayscale 0 %, the others 50 %)."""
    image = checkerboard()
    torch.manual_seed(0)
    ours = Counter(which_operation(ours_three_augment()(image)) for _ in range(DRAWS))
    random.seed(0)
    torch.manual_seed(0)
    deit = deit_three_augment()
    theirs = Counter(which_operation(_tensor(deit(_pil(image)))) for _ in range(DRAWS))
    for kind in ("grayscale", "solarize", "blur"):
        assert _band(ours[kind], 1 / 3), (kind, ours)
        assert _band(theirs[kind], 1 / 3), (kind, theirs)  # the reference reads as DeiT's


def test_three_augment_jitter_spans_deits_range():
    """A uniform grey: grayscale and blur change nothing, solarize 128 -> 127, contrast and
    saturation nothing; what varies is brightness, uniform in [0.7, 1.3] times the grey, as
    DeiT's ColorJitter(0.3), within the levels the grey's rounding moves (contrast blends with
    the image's luma, rounded). Caught: a jitter of 0.4 (its quartiles move by 6 levels)."""
    image = torch.full((3, 16, 16), 128, dtype=torch.uint8)
    torch.manual_seed(1)
    ours = torch.tensor([float(ours_three_augment()(image)[0, 0, 0]) for _ in range(DRAWS)])
    random.seed(1)
    torch.manual_seed(1)
    deit = deit_three_augment()
    theirs = torch.tensor([float(_tensor(deit(_pil(image)))[0, 0, 0]) for _ in range(DRAWS)])
    for values in (ours, theirs):
        assert values.min() >= 0.7 * 127 - 3 and values.max() <= 1.3 * 128 + 3
        assert values.min() <= 95 and values.max() >= 160  # the whole range is reached
    quartiles = torch.tensor([0.25, 0.5, 0.75])
    torch.testing.assert_close(
        ours.quantile(quartiles), theirs.quantile(quartiles), atol=4.0, rtol=0
    )


def test_three_augment_operations_compute_what_pils_do():
    """Solarize is PIL's exactly; grayscale within one level (PIL rounds its integer luma);
    the blur at sigma s is PIL's GaussianBlur(radius=s) within a level on average (PIL
    approximates the Gaussian by box blurs). Caught: a threshold of 127, a 5x5 kernel (which
    cuts the widest blur: 3 levels off)."""
    torch.manual_seed(2)
    image = torch.randint(0, 256, (3, 48, 48), dtype=torch.uint8)
    ops = transforms._three_augment_ops()[0].transforms
    gray, solarize, blur = ops
    assert torch.equal(solarize(image), _tensor(ImageOps.solarize(_pil(image))))
    pil_gray = _tensor(_pil(image).convert("L").convert("RGB"))
    assert (gray(image).int() - pil_gray.int()).abs().max() <= 1
    smooth = F.gaussian_blur(image.float()[None], [9, 9], [3.0, 3.0])[0].round().to(torch.uint8)
    for sigma in (0.5, 1.0, 2.0):
        ours = F.gaussian_blur(smooth, list(blur.kernel_size), [sigma, sigma])
        theirs = _tensor(_pil(smooth).filter(ImageFilter.GaussianBlur(radius=sigma)))
        inner = (slice(None), slice(8, -8), slice(8, -8))  # borders: PIL and torch pad apart
        assert (ours.float() - theirs.float())[inner].abs().mean() <= 1.0, sigma
    assert blur.sigma == list(transforms.THREE_AUGMENT_BLUR_SIGMA)


def test_three_augment_crop_flip_and_jitter_parameters_are_deits():
    """The crop (timm's RandomResizedCropAndInterpolation: 8-100 % of the area, aspect ratios
    3/4-4/3, bicubic), the flip (p 0.5) and the jitter's ranges, attribute by attribute."""
    crop, flip, _, jitter = transforms._three_augment(224, train=True)
    assert crop.scale == (0.08, 1.0) and crop.ratio == pytest.approx((3 / 4, 4 / 3))
    assert crop.interpolation == v2.InterpolationMode.BICUBIC
    assert flip.p == 0.5
    reference = v1.ColorJitter(0.3, 0.3, 0.3)
    assert (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue) == (
        reference.brightness,
        reference.contrast,
        reference.saturation,
        None,
    )


def test_the_flip_fires_half_the_time():
    """Caught: a flip of p 1.0 in the preset."""
    image = torch.zeros(3, 16, 16, dtype=torch.uint8)
    image[:, :, :8] = 200  # left half bright
    preset = transforms.build_transform("three_augment_src", 16, train=True)
    torch.manual_seed(3)
    flips = 0
    for _ in range(DRAWS):
        out = preset(image).float()
        flips += bool(out[:, :, 8:].mean() > out[:, :, :8].mean())
    assert _band(flips, 0.5), flips


def _column_codes(size):
    """An image whose column j holds the value 10 + 5 j in every pixel and channel."""
    columns = torch.arange(size, dtype=torch.uint8) * 5 + 10
    return columns.expand(3, size, size).contiguous()


def test_simple_random_crop_offsets_as_deits():
    """DeiT's --src: Resize(size) (a no-op at the size), RandomCrop(size, padding=4, reflect):
    the crop starts at each of the 9 offsets of the padded image equally often, here and in
    torchvision's RandomCrop on PIL images as DeiT runs it; the reflected border is the same.
    Caught: padding 8 (17 offsets), zero padding."""
    size = 16
    image = _column_codes(size)
    padded = F.pad(image, [4, 4, 4, 4], padding_mode="reflect")
    crop_stage = transforms._three_augment_src(size, train=True)[:2]
    ours, theirs = Counter(), Counter()
    torch.manual_seed(4)
    for _ in range(DRAWS):
        out = v2.Compose(crop_stage)(image)
        offset = next(j for j in range(9) if torch.equal(out[0, 0], padded[0, 0, j : j + size]))
        ours[offset] += 1
    deit = v1.RandomCrop(size, padding=4, padding_mode="reflect")
    torch.manual_seed(4)
    for _ in range(DRAWS):
        out = _tensor(deit(_pil(image)))
        theirs[next(j for j in range(9) if torch.equal(out[0, 0], padded[0, 0, j : j + size]))] += 1
    for offset in range(9):
        assert _band(ours[offset], 1 / 9) and _band(theirs[offset], 1 / 9), (ours, theirs)


@pytest.mark.parametrize(
    "preset", ["three_augment", "three_augment_src", "big_vision", "deit3_finetune"]
)
def test_recipe_presets_give_uint8_squares_in_range(preset):
    """Any input size and aspect gives a uint8 (3, size, size) for training and evaluation."""
    torch.manual_seed(5)
    for h, w in ((40, 64), (24, 24), (90, 33)):
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
        for train in (True, False):
            out = transforms.build_transform(preset, 24, train)(image)
            assert out.dtype == torch.uint8 and out.shape == (3, 24, 24)


def test_three_augment_evaluates_as_deit_iii_does():
    """--eval-crop-ratio 1.0, bicubic: the shorter side to the size, the centre crop (timm's
    crop_pct 1.0); big_vision's: 256 -> 224."""
    assert transforms.eval_data_config("three_augment", 224)["crop_pct"] == 1.0
    assert transforms.eval_data_config("three_augment", 224)["interpolation"] == "bicubic"
    resize, crop = transforms._three_augment(224, train=False)
    assert resize.size == [224] and crop.size == (224, 224)
    resize, crop = transforms._big_vision(224, train=False)
    assert resize.size == [256] and crop.size == (224, 224)


def test_big_vision_preset_is_its_configs_pipeline():
    """decode_jpeg_and_inception_crop(224) (area 5-100 %, ratio 0.75-1.33, bilinear without
    antialiasing), flip_lr, randaug(2, 10) at TF's largest magnitude (bin 10 of 0-10), grey
    fill; big_vision at 0127fb6, pp/ops_image.py and pp/archive/autoaugment.py."""
    crop, flip, randaug = transforms._big_vision(224, train=True)
    assert crop.scale == (0.05, 1.0) and crop.ratio == (0.75, 1.33)
    assert crop.interpolation == v2.InterpolationMode.BILINEAR and crop.antialias is False
    assert flip.p == 0.5
    assert (randaug.num_ops, randaug.magnitude, randaug.num_magnitude_bins) == (2, 10, 11)
    assert randaug.fill == 128


# ---- deit3_finetune: DeiT III's fine-tuning augmentation, timm's RandAugment ----------------- #


def deit_finetune_transform():
    """DeiT III's fine-tuning train transform as DeiT's datasets.py builds it (facebookresearch/deit
    at 7e160fe, build_transform, with README_revenge.md's fine-tuning values and main.py's
    defaults: --color-jitter 0.3, --aa rand-m9-mstd0.5-inc1, bicubic, --reprob 0.0)."""
    timm_data = pytest.importorskip("timm.data")
    return timm_data.create_transform(
        input_size=224, is_training=True, color_jitter=0.3, auto_augment="rand-m9-mstd0.5-inc1",
        interpolation="bicubic", re_prob=0.0, re_mode="pixel", re_count=1,
    )  # fmt: skip


def test_deit3_finetune_stages_are_deits():
    """timm's pipeline for DeiT III's fine-tune has a crop (8-100 %, 3/4-4/3, bicubic), a flip,
    its RandAugment and no colour jitter or erasing (timm drops the jitter beside RandAugment);
    the preset's stages are those. Caught: a jitter or erasing added, torchvision's RandAugment."""
    theirs = [type(t).__name__ for t in deit_finetune_transform().transforms]
    stages = ["RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "RandAugment"]
    assert theirs[:3] == stages
    assert not {"ColorJitter", "RandomErasing"} & set(theirs)
    crop, flip, randaug = transforms._deit3_finetune(224, train=True)
    reference = deit_finetune_transform().transforms[0]
    assert crop.scale == reference.scale and crop.ratio == pytest.approx(reference.ratio)
    assert crop.interpolation == v2.InterpolationMode.BICUBIC and flip.p == 0.5
    assert type(randaug).__name__ == "TimmRandAugment"
    assert transforms.eval_data_config("deit3_finetune", 224)["crop_pct"] == 1.0  # ratio 1.0
    resize, center = transforms._deit3_finetune(224, train=False)
    assert resize.size == [224] and center.size == (224, 224)
    assert resize.interpolation == v2.InterpolationMode.BICUBIC


def test_deit3_finetune_randaugment_is_timms_draw_for_draw():
    """For each torch seed the preset's RandAugment gives what timm's (from DeiT's pipeline above)
    gives with Python's and NumPy's generators seeded as the preset seeds them: the same ops, the
    same magnitudes and fill, pixel for pixel. timm's own raises on the ~0.2 % of draws that keep
    0 bits in posterize (next test): those are left out here. Caught: torchvision's RandAugment
    (2, 9), magnitude 10, no magnitude noise, another fill."""
    theirs = deit_finetune_transform().transforms[2]
    ours = transforms._deit3_finetune(224, train=True)[2]
    generator = torch.Generator().manual_seed(7)
    compared = 0
    for k in range(60):
        image = torch.randint(0, 256, (3, 40, 48), dtype=torch.uint8, generator=generator)
        torch.manual_seed(k)
        seed = int(torch.randint(0, 2**32, (), dtype=torch.int64))  # what the preset draws
        random.seed(seed)
        np.random.seed(seed)
        try:
            expected = _tensor(theirs(_pil(image)))
        except ValueError:  # posterize keeping 0 bits: refused by this Pillow
            continue
        torch.manual_seed(k)
        assert torch.equal(ours(image), expected), k
        compared += 1
    assert compared >= 55


def test_deit3_finetune_posterize_keeping_no_bits_is_black():
    """At magnitude 10 PosterizeIncreasing keeps 0 bits: a black image (Pillow's mask for 0 bits),
    where recent Pillow raises; other bit counts are Pillow's posterize. Caught: timm's posterize
    left in place (ValueError), 0 bits read as 8 (the image unchanged)."""
    ours = transforms._deit3_finetune(224, train=True)[2]
    (op,) = [op for op in ours.transform.ops if op.name == "PosterizeIncreasing"]
    image = _pil(torch.randint(1, 256, (3, 16, 16), dtype=torch.uint8))
    assert not np.asarray(op.aug_fn(image, 0)).any()
    assert np.array_equal(np.asarray(op.aug_fn(image, 3)), np.asarray(ImageOps.posterize(image, 3)))
    op.prob, op.magnitude, op.magnitude_std = 1.0, 10, 0  # this op alone, at its largest
    assert not np.asarray(op(image)).any()


def test_deit3_finetune_is_seeded_by_torch_and_leaves_other_generators_alone():
    """The loader seeds torch per sample: the same torch seed gives the same image, another seed
    another; Python's and NumPy's generators are as they were (a run's other draws do not depend
    on the augmentation). Caught: timm's draws from unseeded global generators."""
    ours = transforms.build_transform("deit3_finetune", 32, train=True)
    image = torch.randint(0, 256, (3, 48, 40), dtype=torch.uint8)
    outs = []
    for seed in (0, 0, 1):
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(seed)
        outs.append(ours(image))
        assert random.random() == random.Random(99).random()
        assert np.random.random() == np.random.RandomState(99).random()
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_the_config_offers_every_preset_and_policy():
    """TRAIN.AUGMENT takes "default" and every preset of transforms.PRESETS, TRAIN.AUTO_AUGMENT
    every policy of AUTO_AUGMENTS: the data section keeps its own copy of each list (reading a
    config imports no torch). Caught: a preset added to PRESETS alone, which every other test
    passes and no config can ask for."""
    assert tuple(data.CHOICES["TRAIN.AUGMENT"]) == ("default", *transforms.PRESETS)
    assert tuple(data.CHOICES["TRAIN.AUTO_AUGMENT"]) == transforms.AUTO_AUGMENTS
