"""A data set prepared once into memory-mapped shards: the format, and reading it
(``ShardDataset``, ``verify_split``); ``pycls.datasets.formats.prepared_shard_writer.prepare_split``
writes it.

Decoding full-size JPEGs and resizing them costs more CPU per image than a fast GPU spends on a
ViT-B/16 step, so that work is done once, ahead of training. One split of a prepared data set:

    SPLIT/
      shard_00000.bin ...  the images back to back: raw uint8 (3, S, S) arrays, or JPEG files
      shard_00000.npz ...  per image: label, byte length, index in the source data set
      manifest.json        progress of the preparation: its settings and the finished shards
      index.npz            per image: label, shard, byte offset and length, source index, CRC32
      index.json           what the split holds (format, S, classes, shards, each shard's size
                           and CRC32, index.npz's size and CRC32); written last, so its
                           presence means the split is complete
      bad_images.txt       the images that could not be read, one "path<TAB>reason" per line

Resize policy: the shorter side is resized to S (bilinear, antialiased), then the centre S x S
square is cut out. Keep S above the training size (256 or 288 for 224 training) so that random
resized crops still see context; size 0 keeps the native size of data sets whose images are all
the same square (CIFAR 32, digits 8).

Integrity: opening a split checks index.json, index.npz (size and CRC32) and every shard's size,
so a truncated or garbled file fails at once with an error naming it. Each sample's bytes are
checked against their CRC32 when read: a flipped byte is a ``CorruptImageError`` naming the shard
file and the index (skippable with DATA_LOADER.SKIP_CORRUPT), never a silently different image.
``verify_split`` (``tools/prepare_dataset.py --verify``) checks every shard's CRC32 in full.

Leaf code: nothing here reads the global config.
"""

import json
import math
import os
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pycls.checkpoint.files import CorruptFileError, verify_file
from pycls.datasets.formats.decode import decode_jpegs
from pycls.datasets.formats.image_header import DEFAULT_MAX_PIXELS, too_many_pixels
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.formats.labels import check_range

FORMAT_VERSION = 1
FORMATS = ("raw", "jpeg")
INDEX_JSON = "index.json"
INDEX_NPZ = "index.npz"
MANIFEST = "manifest.json"
BAD_IMAGES = "bad_images.txt"


_NPY_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an index ``.npz`` (``np.savez``: stored members), each member's claimed
    shape checked against its bytes before numpy allocates it (numpy allocates what a header
    claims, then reads): a crafted 1 KB index could otherwise claim terabytes."""
    if not path.is_file():  # a FIFO would block the read
        raise CorruptFileError(f"shard index {path} is missing or no regular file")
    size = path.stat().st_size
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            where = f"shard index {path}: {info.filename}"
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > size:
                raise CorruptFileError(f"{where} is compressed or larger than the file")
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version not in _NPY_HEADER_READERS:
                    raise CorruptFileError(f"{where} is of .npy version {version}")
                shape, _, dtype = _NPY_HEADER_READERS[version](member)
                claimed = math.prod(shape) * dtype.itemsize
                held = info.file_size - member.tell()
            if claimed > held:
                raise CorruptFileError(f"{where} claims {claimed} bytes, holds {held}")
    with np.load(path) as arrays:
        return dict(arrays)


# ------------------------------------------------------------------------------------------------ #
# Reading
# ------------------------------------------------------------------------------------------------ #

# Splits that name the same held-out part (as the CIFAR and digits readers treat them).
_SPLIT_ALIASES = {"val": "test", "test": "val"}


def _split_folder(path: Path, split: str) -> Path:
    for name in (split, _SPLIT_ALIASES.get(split)):
        if name and (path / name / INDEX_JSON).is_file():
            return path / name
    if (path / split / MANIFEST).is_file():
        raise FileNotFoundError(
            f"the preparation of {path / split} is unfinished (no {INDEX_JSON}); rerun "
            "tools/prepare_dataset.py with the same arguments to finish it"
        )
    found = sorted(p.parent.name for p in path.glob(f"*/{INDEX_JSON}"))
    raise FileNotFoundError(
        f"no prepared {split!r} split in {path} (expected {path / split / INDEX_JSON}); "
        f"prepared splits there: {found or 'none'}. See tools/prepare_dataset.py"
    )


class ShardDataset(Dataset):
    """Raw ``(uint8 (3, S, S), label)`` samples of one prepared split, memory-mapped.

    JPEG shards are decoded on the CPU (in the loader workers) unless ``decode`` is False: then
    samples are the JPEG bytes as a 1-D uint8 tensor, for decoding on the GPU
    (``pycls.datasets.loading.gpu_augment``). Attributes: ``format``, ``image_size`` (S),
    ``num_classes``, ``classes`` (or None), ``dataset`` (the source data set's name), ``labels``. A
    JPEG declaring more than ``max_pixels`` pixels is refused undecoded, wherever it would be
    decoded.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        split: str,
        decode: bool = True,
        skip_corrupt: bool = False,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        unlisted: str = "refuse",
    ):
        self.folder = _split_folder(Path(path), split)
        info = _read_index_json(self.folder / INDEX_JSON)
        if info["version"] != FORMAT_VERSION:
            raise ValueError(
                f"{self.folder} has shard format version {info['version']}, this pycls reads "
                f"{FORMAT_VERSION}; prepare it again"
            )
        self.format, self.image_size = info["format"], info["image_size"]
        self.num_classes, self.classes = info["num_classes"], info["classes"]
        self.dataset, self.decode, self.max_pixels = info["dataset"], decode, max_pixels
        self._files = info["shards"]
        _check_unlisted(self.folder, self._files, unlisted == "skip")
        index = _read_index_npz(self.folder / INDEX_NPZ, info.get("index_checksum"))
        self.labels = torch.from_numpy(_checked_labels(index, info, self.folder / INDEX_NPZ))
        self._shard, self._start = index["shard"], index["start"]
        self._length, self.source_index = index["length"], index["source"]
        self._crc = index.get("crc")  # absent in shards prepared by an older pycls
        self._maps: dict[int, np.memmap] = {}
        _check_shard_sizes(self.folder, self._files, info.get("shard_checksums"), skip_corrupt)

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        # Memory maps are opened again in each worker rather than pickled.
        return {**self.__dict__, "_maps": {}}

    def _map(self, shard: int) -> np.memmap:
        if shard not in self._maps:
            path = self.folder / self._files[shard]
            self._maps[shard] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[shard]

    def encoded(self, index: int) -> torch.Tensor:
        """The stored bytes of sample ``index`` (a copy, as a 1-D uint8 tensor)."""
        start, length = int(self._start[index]), int(self._length[index])
        shard = int(self._shard[index])
        try:
            # np.array copies: the tensor must not keep the read-only map alive or be written to
            data = np.array(self._map(shard)[start : start + length])
        except (OSError, ValueError) as err:  # a shard emptied or removed since the open
            raise self._corrupt(index, f"cannot read it: {err}") from err
        if data.size != length:
            raise self._corrupt(index, f"{data.size} of its {length} bytes are there (truncated)")
        if self._crc is not None and zlib.crc32(data) != int(self._crc[index]):
            raise self._corrupt(index, "its bytes fail the CRC32 check (the shard is corrupt)")
        return torch.from_numpy(data)

    def _corrupt(self, index: int, why: str) -> CorruptImageError:
        path = self.folder / self._files[int(self._shard[index])]
        return CorruptImageError(f"corrupt sample {index} of shard {path}: {why}")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data, label = self.encoded(index), int(self.labels[index])
        if self.format == "raw":
            return data.view(3, self.image_size, self.image_size), label
        if why := too_many_pixels(data.numpy(), self.max_pixels):
            raise self._corrupt(index, why)
        if not self.decode:
            return data, label
        try:
            return decode_jpegs(data), label
        except RuntimeError as err:
            raise self._corrupt(index, f"cannot decode its JPEG: {err}") from err


def _checked_labels(index: dict, info: dict, path: Path) -> np.ndarray:
    """The index's labels: integers from 0 to the split's ``num_classes`` - 1, one per sample
    (a label past the class count would index past the model's head)."""
    found = index.get("labels")
    lengths = index.get("length")
    where = f"shard index {path}"
    if found is None or found.ndim != 1 or not np.issubdtype(found.dtype, np.integer):
        raise CorruptFileError(f"{where}: its labels are not one integer per sample")
    if lengths is not None and len(lengths) != len(found):
        raise CorruptFileError(f"{where}: {len(found)} labels for {len(lengths)} samples")
    count = info.get("num_classes")
    limit = (count, "the classes index.json declares") if isinstance(count, int) else None
    found = found.astype(np.int64)
    check_range(found, limit, lambda i: f"{where}: sample {i}")
    return found


def _read_index_json(path: Path) -> dict:
    try:
        info = json.loads(path.read_text())
        if not isinstance(info, dict) or "version" not in info or "shards" not in info:
            raise ValueError("not a shard index (no version or shards)")
        _check_index_fields(info)
        return info
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptFileError(
            f"shard index {path} is unreadable ({type(err).__name__}: {err}); prepare the split "
            "again (tools/prepare_dataset.py)"
        ) from None


def _fields_crc32(info: dict) -> int:
    """CRC32 of the index's own fields (canonical JSON, the checksum itself left out)."""
    fields = {k: v for k, v in info.items() if k != "fields_crc32"}
    return zlib.crc32(json.dumps(fields, sort_keys=True).encode())


def _check_index_fields(info: dict) -> None:
    """The fields that say how to read every sample: a wrong one (an edited index) would make
    every sample unreadable, or read the bytes as the wrong thing. Checked against the index's
    own checksum (indexes an older pycls wrote have none) and for what each field can hold."""
    if "fields_crc32" in info and info["fields_crc32"] != _fields_crc32(info):
        changed = "format, image_size, shards or another field"
        raise ValueError(f"its fields fail their CRC32 check ({changed} was edited)")
    if info.get("format") not in FORMATS:
        raise ValueError(f"format {info.get('format')!r} is not one of {list(FORMATS)}")
    size = info.get("image_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"image_size {size!r} is not a positive integer")
    shards = info["shards"]
    if not isinstance(shards, list) or not all(
        isinstance(n, str) and n and os.path.basename(n) == n and n not in (".", "..")
        for n in shards
    ):
        raise ValueError("shards must be a list of file names in the split's folder")


def _read_index_npz(path: Path, record: dict | None) -> dict[str, np.ndarray]:
    try:
        if record is not None:
            verify_file(path, record, "shard index")
        return _load_npz(path)
    except CorruptFileError as err:
        raise CorruptFileError(f"{err}; prepare the split again") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise CorruptFileError(
            f"shard index {path} is unreadable ({type(err).__name__}: {err}); prepare the split "
            "again (tools/prepare_dataset.py)"
        ) from None


def _check_shard_sizes(folder: Path, files: list, records: list | None, skip_corrupt: bool):
    """Every shard must have the size it was written with (cheap: no data is read)."""
    for name, record in zip(files, records or []):
        try:
            verify_file(str(folder / name), {"size": record["size"]}, "shard")
        except CorruptFileError as err:
            if not skip_corrupt:
                raise CorruptFileError(
                    f"{err}; set DATA_LOADER.SKIP_CORRUPT True to skip its unreadable samples, "
                    "or prepare the split again"
                ) from None
            warnings.warn(f"{err}; its unreadable samples will be skipped", stacklevel=3)


def unlisted_shards(folder: Path, files: list) -> list[str]:
    """The shard files in ``folder`` that its index does not name (never read: left there by
    hand, or by another preparation)."""
    return sorted({p.name for p in folder.glob("shard_*.bin")} - set(files))


def _check_unlisted(folder: Path, files: list, skip: bool) -> None:
    extra = unlisted_shards(folder, files)
    if not extra:
        return
    more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
    what = f"{folder / extra[0]}{more} is not named in {folder / INDEX_JSON}, which lists the split"
    if not skip:
        raise CorruptFileError(
            f"{what}: a file from elsewhere. Remove it, prepare the split again, or set "
            "DATA_LOADER.UNLISTED_SHARDS skip to read only the listed shards"
        )
    warnings.warn(f"{what}: not read (DATA_LOADER.UNLISTED_SHARDS skip)", stacklevel=3)


def verify_split(folder: str | os.PathLike) -> list[str]:
    """Checks index.json, index.npz and every shard of a prepared split in full (CRC32 of every
    byte); returns the problems found (empty: all good)."""
    folder = Path(folder)
    try:
        info = _read_index_json(folder / INDEX_JSON)
        _read_index_npz(folder / INDEX_NPZ, info.get("index_checksum"))
    except (CorruptFileError, OSError) as err:
        return [str(err)]
    records = info.get("shard_checksums")
    if records is None:
        return [f"{folder}: prepared without checksums (an older pycls); prepare it again"]
    problems = [f"{folder / name}: not named in {INDEX_JSON}" for name in
                unlisted_shards(folder, info["shards"])]  # fmt: skip
    for name, record in zip(info["shards"], records):
        try:
            verify_file(str(folder / name), record, "shard")
        except CorruptFileError as err:
            problems.append(str(err))
    return problems
