"""timm's RandAugment on pycls's uint8 image tensors, as DeiT and DeiT III run it (``--aa
rand-m9-mstd0.5-inc1``: ``timm.data.create_transform``), for the ``deit3_finetune`` preset.

timm's operations work on PIL images and draw from Python's ``random`` and NumPy's global
generators. Each call converts the image to PIL and back, and seeds both generators from torch's
(which the loader seeds per sample), restoring their states afterwards: a sample's augmentation is
the same in every run and after a resume, and nothing else in the process sees its draws.
"""

import contextlib
import functools
import random
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from pycls.errors import ConfigError

# DeiT's --aa default and DeiT III's fine-tuning value (facebookresearch/deit at 7e160fe, main.py
# and README_revenge.md): 2 operations per image of the increasing-severity set, each applied with
# probability 0.5, at magnitude 9 of 10 with Gaussian noise of standard deviation 0.5
DEIT_RAND_AUGMENT = "rand-m9-mstd0.5-inc1"
# timm's IMAGENET_DEFAULT_MEAN in bytes: the fill of the geometric operations (create_transform's
# img_mean)
_FILL = tuple(min(255, round(255 * m)) for m in (0.485, 0.456, 0.406))


class TimmRandAugment:
    """timm's ``rand_augment_transform(policy, hparams)`` (``policy``: its string, as
    ``--aa``) with the hparams ``create_transform`` gives it for a square ``image_size`` and
    bicubic interpolation, on a uint8 (3, H, W) tensor."""

    def __init__(self, policy: str, image_size: int):
        try:
            # optional: the deit3_finetune preset only (a config refuses it without timm)
            from timm.data import auto_augment
        except ImportError:
            raise ConfigError(
                "TRAIN.AUGMENT: deit3_finetune runs timm's RandAugment: it needs the timm "
                "package (pip install timm, or pycls-vit[timm])"
            ) from None
        hparams = dict(
            translate_const=int(image_size * 0.45), img_mean=_FILL, interpolation=Image.BICUBIC
        )
        self.policy = policy
        self.transform = auto_augment.rand_augment_transform(policy, hparams)
        for op in self.transform.ops:
            if op.aug_fn is auto_augment.posterize:
                op.aug_fn = functools.partial(_posterize_keeping_no_bits, op.aug_fn)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        seed = int(torch.randint(0, 2**32, (), dtype=torch.int64))
        with _python_and_numpy_seeded(seed):
            out = self.transform(F.to_pil_image(image))
        return F.pil_to_tensor(out)

    def __repr__(self) -> str:
        return f"TimmRandAugment({self.policy!r})"


@contextlib.contextmanager
def _python_and_numpy_seeded(seed: int) -> Iterator[None]:
    """Python's and NumPy's global generators seeded with ``seed`` inside, as they were after."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _posterize_keeping_no_bits(posterize, img: Image.Image, bits_to_keep: int, **kwargs):
    """timm's ``posterize``, where 0 bits kept gives a black image. ``PosterizeIncreasing`` keeps
    ``4 - int(magnitude / 10 * 4)`` bits: 0 at the magnitude 10 that ``mstd0.5`` around 9 reaches
    in about 2 % of its draws. Pillow's posterize computes the mask of the bits kept, 0 for no
    bits: a black image, which older Pillow returned; recent Pillow refuses 0 bits (ValueError)."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return posterize(img, bits_to_keep, **kwargs)
