"""Image classification folders: ``root/split/CLASS/*.{jpg,jpeg,png}`` (ImageNet layout)."""

import os
import warnings
from pathlib import Path

import torch
from torchvision.datasets.folder import find_classes, make_dataset
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2.functional import to_dtype

from pycls.datasets.image_header import DEFAULT_MAX_PIXELS, too_many_pixels
from pycls.errors import printable_path

EXTENSIONS = (".jpg", ".jpeg", ".png")


class CorruptImageError(ValueError):
    """An image file that cannot be decoded; the message names the file and the reason."""


def _read_bytes(path: str, max_pixels: int) -> torch.Tensor:
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise CorruptImageError(f"cannot decode image {printable_path(path)}: the file is empty")
    if why := too_many_pixels(data, max_pixels):  # before a pixel is decoded
        raise CorruptImageError(f"refusing image {printable_path(path)}: {why}")
    # bytearray: torch.frombuffer wants a writable buffer and the tensor must own its memory.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_rgb(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """Decode an image file to a uint8 (3, H, W) tensor, whatever its channels or bit depth.
    An image declaring more than ``max_pixels`` pixels (0: no limit) is refused undecoded."""
    data = _read_bytes(path, max_pixels)
    try:
        with warnings.catch_warnings():
            # torchvision 0.29 deprecates its decoders in favour of torchcodec, and warns on every
            # call; one warning per sample would drown the logs.
            warnings.simplefilter("ignore", DeprecationWarning)
            image = decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError as err:
        raise CorruptImageError(f"cannot decode image {printable_path(path)}: {err}") from err
    if image.dtype != torch.uint8:  # 16-bit PNGs decode to uint16
        image = to_dtype(image, torch.uint8, scale=True)
    return image


class ImageFolder(torch.utils.data.Dataset):
    """Raw ``(uint8 (3, H, W), label)`` samples from ``root/split/CLASS/``.

    Classes are the sorted sub-folder names of this split, so every split must hold the same
    class folders for the labels to agree. Images declaring more than ``max_pixels`` pixels are
    refused as corrupt (``decode_rgb``).
    """

    def __init__(self, root: str | os.PathLike, split: str, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.folder, self.max_pixels = Path(root) / split, max_pixels
        if not self.folder.is_dir():
            raise FileNotFoundError(f"image folder not found: {self.folder}")
        try:
            self.classes, class_to_idx = find_classes(self.folder)
            self.samples = make_dataset(self.folder, class_to_idx, extensions=EXTENSIONS)
        except FileNotFoundError as err:  # torchvision's messages do not always name the folder
            raise FileNotFoundError(f"no images under {self.folder}: {err}") from err
        self.num_classes = len(self.classes)
        self.labels = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return decode_rgb(path, self.max_pixels), label
