"""Image classification folders: ``root/split/CLASS/*.jpg`` (ImageNet layout), every image
format torchvision or PIL decodes (``image_extensions()``)."""

import functools
import os
from pathlib import Path

import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from pycls.datasets import decode

# torchvision's ImageFolder list (jpg, png, webp, bmp, tif, ppm, pgm) and raster formats PIL reads
# too; a name outside it (notes.txt, labels.csv) is not a sample
_MORE_EXTENSIONS = (".gif", ".jfif", ".jpe", ".pbm", ".pnm", ".tga", ".qoi", ".jp2", ".avif")


@functools.cache
def image_extensions() -> tuple[str, ...]:
    """The file name endings taken as images: torchvision's list, plus what this PIL opens."""
    pil = {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}
    return tuple(IMG_EXTENSIONS) + tuple(e for e in _MORE_EXTENSIONS if e in pil)


class CorruptImageError(ValueError):
    """An image file that cannot be decoded; the message names the file and the reason."""


def read_image_bytes(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise CorruptImageError(f"cannot decode image {path}: the file is empty")
    # bytearray: torch.frombuffer wants a writable buffer and the tensor must own its memory.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_rgb(path: str) -> torch.Tensor:
    """Decode an image file to a uint8 (3, H, W) tensor, whatever its channels or bit depth
    (TorchCodec where installed, else torchvision; PIL for what they do not read)."""
    data = read_image_bytes(path)
    try:
        return decode.decode_rgb(data)
    except ValueError as err:
        raise CorruptImageError(f"cannot decode image {path}: {err}") from err


class ImageFolder(torch.utils.data.Dataset):
    """Raw ``(uint8 (3, H, W), label)`` samples from ``root/split/CLASS/``.

    Classes are the sorted sub-folder names of this split, so every split must hold the same
    class folders for the labels to agree.
    """

    def __init__(self, root: str | os.PathLike, split: str):
        self.folder = Path(root) / split
        if not self.folder.is_dir():
            raise FileNotFoundError(f"image folder not found: {self.folder}")
        try:
            self.classes, class_to_idx = find_classes(self.folder)
            self.samples = make_dataset(self.folder, class_to_idx, extensions=image_extensions())
        except FileNotFoundError as err:  # torchvision's messages do not always name the folder
            raise FileNotFoundError(f"no images under {self.folder}: {err}") from err
        self.num_classes = len(self.classes)
        self.labels = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return decode_rgb(path), label
