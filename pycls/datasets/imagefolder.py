"""Image classification folders: ``root/split/CLASS/*.jpg`` (ImageNet layout), every image
format torchvision or PIL decodes (``image_extensions()``)."""

import functools
import io
import os
import warnings
from pathlib import Path

import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2.functional import pil_to_tensor, to_dtype

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


def _read_bytes(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise CorruptImageError(f"cannot decode image {path}: the file is empty")
    # bytearray: torch.frombuffer wants a writable buffer and the tensor must own its memory.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode_pil(data: torch.Tensor) -> torch.Tensor:
    """BMP, TIFF, PPM and the rest torchvision's decoders do not read."""
    with Image.open(io.BytesIO(data.numpy().tobytes())) as im:
        return pil_to_tensor(im.convert("RGB"))


def decode_rgb(path: str) -> torch.Tensor:
    """Decode an image file to a uint8 (3, H, W) tensor, whatever its channels or bit depth."""
    data = _read_bytes(path)
    try:
        with warnings.catch_warnings():
            # torchvision 0.29 deprecates its decoders in favour of torchcodec, and warns on every
            # call; one warning per sample would drown the logs.
            warnings.simplefilter("ignore", DeprecationWarning)
            image = decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError as err:
        try:
            image = _decode_pil(data)
        except Exception:  # PIL cannot read it either: torchvision's reason is the useful one
            raise CorruptImageError(f"cannot decode image {path}: {err}") from err
    if image.dtype != torch.uint8:  # 16-bit PNGs decode to uint16
        image = to_dtype(image, torch.uint8, scale=True)
    return image


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
