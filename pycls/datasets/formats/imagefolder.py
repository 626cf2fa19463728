"""Image classification folders: ``root/split/CLASS/*.jpg`` (ImageNet layout), every image
format torchvision or PIL decodes (``image_extensions()``).

Only regular files are images: a FIFO, a device (a link to ``/dev/zero``) or a dangling link
named like one is refused as corrupt when read (``CorruptImageError`` naming it, skipped under
``DATA_LOADER.SKIP_CORRUPT``), never opened for reading: a FIFO would block the reader forever,
a device feed it without end. The folder walk follows links to folders, but not a link back
into the split folder (to a class folder, itself, a parent: its images would count twice, or
without end) nor to a folder already walked; each link not followed is logged by name.
"""

import functools
import logging
import os
import stat
from pathlib import Path

import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

from pycls.datasets.formats import decode
from pycls.datasets.formats.image_header import DEFAULT_MAX_PIXELS, too_many_pixels
from pycls.errors import UserError, printable_path

# torchvision's ImageFolder list (jpg, png, webp, bmp, tif, ppm, pgm) and raster formats PIL reads
# too; a name outside it (notes.txt, labels.csv) is not a sample
_MORE_EXTENSIONS = (".gif", ".jfif", ".jpe", ".pbm", ".pnm", ".tga", ".qoi", ".jp2", ".avif")

logger = logging.getLogger(__name__)


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


def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device"}
    kinds.update({stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"})
    kinds[stat.S_ISDIR] = "a folder"
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def _read_regular_file(path: str) -> bytes:
    """The bytes of ``path`` if it is a regular file (after links), at most its size; raises
    CorruptImageError naming it otherwise. Opened without blocking: a FIFO swapped in after the
    check does not wait for a writer, and is refused by its descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:  # a dangling link, no permission, ...
        why = err.strerror or type(err).__name__
        if os.path.islink(path) and not os.path.exists(path):
            why += f" (a link to {printable_path(os.readlink(path))}, which does not exist)"
        raise CorruptImageError(f"cannot read image {printable_path(path)}: {why}") from None
    with open(fd, "rb") as f:
        mode = os.fstat(fd)
        if not stat.S_ISREG(mode.st_mode):
            raise CorruptImageError(
                f"refusing image {printable_path(path)}: it is {_file_kind(mode.st_mode)}, not a "
                "regular file"
            )
        return f.read(mode.st_size)


def read_image_bytes(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """The bytes of an image file, refused undecoded when its header declares more than
    ``max_pixels`` pixels (0: no limit), or when it is not a regular file. A file that cannot be
    read (a dangling link, a file removed since the folder was listed, a read error) is as
    corrupt as one that does not decode: skippable, and named."""
    data = _read_regular_file(path)
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
            self.classes, _ = find_classes(self.folder)
        except FileNotFoundError as err:  # torchvision's messages do not always name the folder
            raise FileNotFoundError(f"no images under {self.folder}: {err}") from err
        self.samples = list_samples(self.folder, self.classes, image_extensions())
        if not self.samples:
            raise FileNotFoundError(
                f"no images under {self.folder}: its class folders hold no file ending in "
                f"{', '.join(image_extensions())}"
            )
        self.num_classes = len(self.classes)
        self.labels = [label for _, label in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return decode_rgb(path, self.max_pixels), label


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def list_samples(folder, classes, extensions) -> list[tuple[str, int]]:
    """(path, class index) of every file under ``folder/CLASS/`` ending in one of
    ``extensions``, in torchvision's order (``make_dataset``: walked folders sorted, then names).
    Links to folders are followed, except a link whose target lies in ``folder``, contains it, or
    is walked already: those are logged and left out (a class linking itself or its parent
    would otherwise count its images up to 40 times per link, the kernel's link limit)."""
    root = os.path.realpath(folder)
    samples, walked = [], set()
    for label, name in enumerate(classes):
        top = os.path.join(folder, name)
        if os.path.islink(top) and not _follow(top, root, walked):
            continue
        walked.add(os.path.realpath(top))
        found = []
        for here, subfolders, names in os.walk(top, followlinks=True):
            subfolders[:] = [d for d in subfolders if _follow(os.path.join(here, d), root, walked)]
            found.append((here, [n for n in names if n.lower().endswith(extensions)]))
        for here, names in sorted(found):
            samples += [(os.path.join(here, n), label) for n in sorted(names)]
    return samples


def _follow(path: str, root: str, walked: set) -> bool:
    """Whether the folder walk enters the folder ``path`` (recorded in ``walked`` if so): not
    when it is a link into the split folder ``root`` or above it, nor a folder walked already
    (logged)."""
    target = os.path.realpath(path)
    if os.path.islink(path) and (_inside(target, root) or _inside(root, target)):
        why = "back into the image folder (a loop, or its images counted twice)"
    elif target in walked:
        why = "to a folder already read (its images would count twice)"
    else:
        walked.add(target)
        return True
    logger.warning(f"not entering {printable_path(path)} (it is {target}): it leads {why}")
    return False
