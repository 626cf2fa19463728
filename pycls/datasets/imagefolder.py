"""Image classification folders: ``root/split/CLASS/*.jpg`` (ImageNet layout), every image
format torchvision or PIL decodes (``image_extensions()``)."""

import functools
import os
from pathlib import Path

import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from pycls.datasets import decode
from pycls.datasets.image_header import DEFAULT_MAX_PIXELS, too_many_pixels
from pycls.errors import UserError, printable_path

# torchvision's ImageFolder list (jpg, png, webp, bmp, tif, ppm, pgm) and raster formats PIL reads
# too; a name outside it (notes.txt, labels.csv) is not a sample
_MORE_EXTENSIONS = (".gif", ".jfif", ".jpe", ".pbm", ".pnm", ".tga", ".qoi", ".jp2", ".avif")


@functools.cache
def image_extensions() -> tuple[str, ...]:
    """The file name endings taken as images: torchvision's list, plus what this PIL opens."""
    pil = {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}
    return tuple(IMG_EXTENSIONS) + tuple(e for e in _MORE_EXTENSIONS if e in pil)


class CorruptImageError(UserError, ValueError):
    """An image file that cannot be read or decoded; the message names the file and the reason,
    and the one line the commands print says which key skips such files."""

    def one_line(self):
        return super().one_line() + (
            " (DATA_LOADER.SKIP_CORRUPT True skips such files, naming them in the log)"
        )


def read_image_bytes(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """The bytes of an image file, refused undecoded when its header declares more than
    ``max_pixels`` pixels (0: no limit). A file that cannot be read (a dangling link, a file
    removed since the folder was listed, a read error) is as corrupt as one that does not
    decode: skippable, and named."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        why = err.strerror or str(err)
        if os.path.islink(path) and not os.path.exists(path):
            why = f"a link to {printable_path(os.readlink(path))}, which does not exist"
        raise CorruptImageError(f"cannot read image {printable_path(path)}: {why}") from None
    if not data:
        raise CorruptImageError(f"cannot decode image {printable_path(path)}: the file is empty")
    if why := too_many_pixels(data, max_pixels):  # before a pixel is decoded
        raise CorruptImageError(f"refusing image {printable_path(path)}: {why}")
    # bytearray: torch.frombuffer wants a writable buffer and the tensor must own its memory.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_rgb(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """Decode an image file to a uint8 (3, H, W) tensor, whatever its channels or bit depth
    (TorchCodec where installed, else torchvision; PIL for what they do not read). An image
    declaring more than ``max_pixels`` pixels (0: no limit) is refused undecoded."""
    data = read_image_bytes(path, max_pixels)
    try:
        return decode.decode_rgb(data)
    except ValueError as err:
        raise CorruptImageError(f"cannot decode image {printable_path(path)}: {err}") from err


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
            self.samples = make_dataset(self.folder, class_to_idx, extensions=image_extensions())
        except FileNotFoundError as err:  # torchvision's messages do not always name the folder
            raise FileNotFoundError(f"no images under {self.folder}: {err}") from err
        self.num_classes = len(self.classes)
        self.labels = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return decode_rgb(path, self.max_pixels), label
