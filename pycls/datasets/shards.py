"""A data set prepared once into memory-mapped shards: writing (``prepare_split``) and reading
(``ShardDataset``).

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

Preparation is restartable: each shard is written under a temporary name of its writer's own
(``NAME.tmp.PID``), read back and checked against the size and CRC32 it was written with, renamed
when complete, then recorded in the manifest; a rerun with the same settings removes what killed
writers left, skips recorded shards, and the result is byte-identical to an uninterrupted run.
The writing processes die with the preparation's own process (a kill of it, even SIGKILL, leaves
no orphan writing into the folder). Unreadable images are recorded with their path and skipped,
never fatal.

Integrity: opening a split checks index.json, index.npz (size and CRC32) and every shard's size,
so a truncated or garbled file fails at once with an error naming it. Each sample's bytes are
checked against their CRC32 when read: a flipped byte is a ``CorruptImageError`` naming the shard
file and the index (skippable with DATA_LOADER.SKIP_CORRUPT), never a silently different image.
``verify_split`` (``tools/prepare_dataset.py --verify``) checks every shard's CRC32 in full.

Leaf code: nothing here reads the global config.
"""

import ctypes
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import encode_jpeg
from torchvision.transforms.v2 import functional as TF

from pycls.checkpoint.files import CorruptFileError, file_record, verify_file
from pycls.datasets.decode import decode_jpegs, quiet
from pycls.datasets.image_header import DEFAULT_MAX_PIXELS, too_many_pixels
from pycls.datasets.imagefolder import CorruptImageError
from pycls.datasets.labels import check_range
from pycls.errors import EnvironmentFailure, one_line, printable_path

FORMAT_VERSION = 1
FORMATS = ("raw", "jpeg")
INDEX_JSON = "index.json"
INDEX_NPZ = "index.npz"
MANIFEST = "manifest.json"
BAD_IMAGES = "bad_images.txt"
_TMP = ".tmp"  # NAME.tmp.PID: a file being written by process PID (NAME.tmp: by an older pycls)

# Default images per shard: about 1 GiB of raw pixels, or this many JPEGs (~0.2-0.3 GB at 256 px).
_RAW_SHARD_BYTES = 1 << 30
_JPEG_SHARD_IMAGES = 8192


# ------------------------------------------------------------------------------------------------ #
# Images: resize policy and encoding
# ------------------------------------------------------------------------------------------------ #


def resize_center_square(image: torch.Tensor, size: int) -> torch.Tensor:
    """The shorter side to ``size`` (bilinear, antialiased), then the centre size x size square."""
    image = TF.resize(image, [size], antialias=True)
    return TF.center_crop(image, [size, size]).contiguous()


def _encode(image: torch.Tensor, fmt: str, quality: int) -> np.ndarray:
    if fmt == "raw":
        return image.numpy().reshape(-1)
    return quiet(encode_jpeg, image, quality=quality).numpy()


# ------------------------------------------------------------------------------------------------ #
# Writing
# ------------------------------------------------------------------------------------------------ #


@dataclass
class PrepareResult:
    """What ``prepare_split`` did. ``complete`` is False when it stopped early (``stop_after``)."""

    folder: Path
    num_shards: int
    shards_written: int
    shards_skipped: int
    complete: bool
    num_samples: int = 0
    nbytes: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        if not self.complete:
            done = self.shards_written + self.shards_skipped
            return (
                f"{self.folder}: stopped after {done} of {self.num_shards} shards "
                f"({self.shards_skipped} were already done); rerun to finish"
            )
        return (
            f"{self.folder}: {self.num_samples} images in {self.num_shards} shard(s), "
            f"{self.nbytes / 2**20:.1f} MiB ({self.shards_written} written, "
            f"{self.shards_skipped} already done); {len(self.bad)} bad image(s)"
            + (f", listed in {self.folder / BAD_IMAGES}" if self.bad else "")
        )


def _shard_name(shard: int) -> str:
    return f"shard_{shard:05d}"


class ShardWriteError(CorruptFileError, EnvironmentFailure):
    """A shard read back after writing is not what was written: the disk lost bytes without an
    error (the machine's failure, exit status 1, not the input's)."""


def _write_atomic(path: Path, write: Callable, expected: Callable[[], dict] | None = None) -> None:
    """``write(file)`` into a temporary file next to ``path`` of this process's own, then rename
    it over ``path``. ``expected()``: the {"size", "crc32"} the file must have, checked on the
    bytes read back before the rename (CorruptFileError otherwise, nothing renamed)."""
    tmp = path.with_name(f"{path.name}{_TMP}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            # On disk before the rename: a crash must not leave a complete-looking, truncated file.
            f.flush()
            os.fsync(f.fileno())
        if expected is not None:
            try:
                verify_file(str(tmp), expected(), "shard being written")
            except CorruptFileError as e:
                raise ShardWriteError(str(e)) from None
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_json(path: Path, obj) -> None:
    _write_atomic(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def _source_path(source: Dataset, index: int) -> str:
    """How a bad image is named in the report: its file when the source has one."""
    samples = getattr(source, "samples", None)
    if samples is not None:
        return printable_path(samples[index][0])
    return f"{type(source).__name__}[{index}]"


def _prepared_image(source: Dataset, index: int, size: int, resize: bool) -> tuple:
    image, label = source[index]
    if resize:
        return resize_center_square(image, size), label
    if tuple(image.shape) != (3, size, size):
        raise CorruptImageError(
            f"image is {tuple(image.shape)}, expected (3, {size}, {size}): size 0 keeps the native "
            "size, which must be the same square for every image"
        )
    return image.contiguous(), label


def write_shard(
    source: Dataset,
    folder: Path,
    shard: int,
    settings: dict,
    on_image: Callable[[], None] | None = None,
) -> dict:
    """Write shard number ``shard`` of ``source``; returns its manifest record.

    The shard covers source indices [shard * n, (shard + 1) * n) with n = settings["shard_size"].
    Images that fail to read (``CorruptImageError``, ``OSError``) are left out and reported.
    """
    n, size, fmt = settings["shard_size"], settings["image_size"], settings["format"]
    indices = range(shard * n, min((shard + 1) * n, settings["num_source"]))
    labels, lengths, sources, crcs, bad = [], [], [], [], []
    shard_crc = 0

    def write_images(f):
        nonlocal shard_crc
        for index in indices:
            try:
                image, label = _prepared_image(source, index, size, settings["resize"])
            except (CorruptImageError, OSError) as err:
                bad.append((_source_path(source, index), str(err)))
            else:
                data = _encode(image, fmt, settings["quality"]).tobytes()
                f.write(data)
                crcs.append(zlib.crc32(data))
                shard_crc = zlib.crc32(data, shard_crc)
                labels.append(label)
                lengths.append(len(data))
                sources.append(index)
            if on_image is not None:
                on_image()

    name = _shard_name(shard)
    written = lambda: {"size": sum(lengths), "crc32": shard_crc}  # noqa: E731
    _write_atomic(folder / f"{name}.bin", write_images, written)
    arrays = dict(
        labels=np.asarray(labels, dtype=np.int64),
        lengths=np.asarray(lengths, dtype=np.int64),
        source=np.asarray(sources, dtype=np.int64),
        crc=np.asarray(crcs, dtype=np.uint32),
    )
    _write_atomic(folder / f"{name}.npz", lambda f: np.savez(f, **arrays))
    return {"count": len(labels), "nbytes": int(sum(lengths)), "crc32": shard_crc, "bad": bad}


def _shard_is_complete(folder: Path, shard: int, record: dict) -> bool:
    name = _shard_name(shard)
    data, meta = folder / f"{name}.bin", folder / f"{name}.npz"
    # Records without a checksum come from an older pycls: such shards are written again
    complete = meta.is_file() and data.is_file() and data.stat().st_size == record["nbytes"]
    return complete and "crc32" in record


# A pool worker's copy of the source and settings (set once per worker by _init_worker).
_WORKER: dict = {}
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies (Linux)
_WATCH_S = 0.2


def die_with_parent(parent_pid: int) -> None:
    """Ends this process when process ``parent_pid`` (its parent) dies, however it dies: at once
    by the kernel on Linux (prctl PR_SET_PDEATHSIG), elsewhere within ``_WATCH_S`` seconds by a
    thread watching the parent's pid. A parent already gone ends it now."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the watching thread alone
    if os.getppid() != parent_pid:  # died before the request took effect
        os._exit(1)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _init_worker(parent_pid: int, source: Dataset, folder: Path, settings: dict) -> None:
    die_with_parent(parent_pid)
    torch.set_num_threads(1)  # one image at a time per process; the pool is the parallelism
    _WORKER.update(source=source, folder=folder, settings=settings)


def _write_shard_in_worker(shard: int) -> tuple[int, dict]:
    w = _WORKER
    return shard, write_shard(w["source"], w["folder"], shard, w["settings"])


def _run_shards(source, folder, settings, shards, workers, on_progress):
    """Writes ``shards``, yielding (shard, record) as each is finished."""
    if workers <= 1 or len(shards) <= 1:
        on_image = (lambda: on_progress(1)) if on_progress is not None else None
        for shard in shards:
            yield shard, write_shard(source, folder, shard, settings, on_image)
        return
    # fork: the workers inherit the source (file lists, CIFAR arrays) instead of rebuilding it.
    context = multiprocessing.get_context("fork")
    initargs = (os.getpid(), source, folder, settings)
    with context.Pool(min(workers, len(shards)), _init_worker, initargs) as pool:
        for shard, record in pool.imap_unordered(_write_shard_in_worker, shards):
            if on_progress is not None:  # workers cannot call back: count whole shards
                on_progress(record["count"] + len(record["bad"]))
            yield shard, record


def _default_shard_size(fmt: str, size: int) -> int:
    if fmt == "raw":
        return max(1, _RAW_SHARD_BYTES // (3 * size * size))
    return _JPEG_SHARD_IMAGES


def _native_size(source: Dataset) -> int:
    image, _ = source[0]
    if image.ndim != 3 or image.shape[1] != image.shape[2]:
        raise ValueError(
            f"size 0 keeps the native size, but the first image is {tuple(image.shape)}, not a "
            "square; give a size"
        )
    return int(image.shape[1])


def _settings(source, dataset, split, fmt, size, quality, shard_size) -> dict:
    if fmt not in FORMATS:
        raise ValueError(f"unknown shard format {fmt!r}; expected one of {FORMATS}")
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
    if size < 0 or (shard_size is not None and shard_size <= 0):
        raise ValueError(f"size must be >= 0 and shard_size > 0, got {size} and {shard_size}")
    if len(source) == 0:
        raise ValueError(f"the {dataset} {split} source holds no images")
    image_size = size or _native_size(source)
    return {
        "version": FORMAT_VERSION,
        "dataset": dataset,
        "split": split,
        "format": fmt,
        "image_size": image_size,
        "resize": size > 0,
        "quality": quality if fmt == "jpeg" else None,
        "shard_size": shard_size or _default_shard_size(fmt, image_size),
        "num_source": len(source),
    }


def _load_manifest(folder: Path, settings: dict) -> dict[int, dict]:
    """The finished shards recorded by an earlier run, after checking its settings are ours."""
    path = folder / MANIFEST
    if not path.is_file():
        return {}
    manifest = json.loads(path.read_text())
    if manifest["settings"] != settings:
        raise ValueError(
            f"{folder} holds a preparation with other settings ({manifest['settings']}); "
            f"these are {settings}. Delete the folder to start again, or write elsewhere"
        )
    records = {int(k): v for k, v in manifest["shards"].items()}
    return {k: r for k, r in records.items() if _shard_is_complete(folder, k, r)}


def _remove_leftovers(folder: Path) -> None:
    """Temporary files of a run that was killed mid-shard (a writer still at work on one, which
    cannot be with writers that die with their preparation, would fail its rename)."""
    for path in [*folder.glob(f"*{_TMP}"), *folder.glob(f"*{_TMP}.*")]:
        path.unlink(missing_ok=True)


def prepare_split(
    source: Dataset,
    folder: str | os.PathLike,
    *,
    dataset: str,
    split: str,
    fmt: str = "raw",
    size: int = 0,
    quality: int = 90,
    shard_size: int | None = None,
    workers: int = 0,
    on_progress: Callable[[int], None] | None = None,
    stop_after: int | None = None,
) -> PrepareResult:
    """Write ``source`` (raw ``(uint8 (3, H, W), label)`` samples) as shards into ``folder``.

    ``fmt`` is "raw" (exact pixels) or "jpeg" (re-encoded at ``quality``); ``size`` the stored
    square side (0: native). ``workers`` > 1 writes shards in that many processes.
    ``on_progress(n)`` is called as n more source images are done (for a progress bar).
    ``stop_after`` stops after writing that many shards, leaving a resumable preparation (used to
    test resuming). ``dataset`` and ``split`` are recorded in the index (the trainer checks that
    the shards are of the data set it was asked for).
    """
    folder = Path(folder)
    settings = _settings(source, dataset, split, fmt, size, quality, shard_size)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(folder)
    done = _load_manifest(folder, settings)
    num_shards = -(-settings["num_source"] // settings["shard_size"])
    pending = [k for k in range(num_shards) if k not in done]
    skipped = num_shards - len(pending)
    if on_progress is not None:
        on_progress(sum(r["count"] + len(r["bad"]) for r in done.values()))
    if stop_after is not None:
        pending = pending[:stop_after]

    for shard, record in _run_shards(source, folder, settings, pending, workers, on_progress):
        done[shard] = record
        shards = {k: done[k] for k in sorted(done)}  # the same file whatever the finishing order
        _write_json(folder / MANIFEST, {"settings": settings, "shards": shards})
    result = PrepareResult(folder, num_shards, len(pending), skipped, len(done) == num_shards)
    if result.complete:
        records = [done[k] for k in range(num_shards)]
        result.num_samples, result.nbytes, result.bad = _write_index(
            source, folder, settings, records
        )
    return result


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


def _write_index(source, folder: Path, settings: dict, records: list[dict]) -> tuple:
    """Merges the shards' metadata into the index; returns (num_samples, nbytes, bad)."""
    per_shard = [_load_npz(folder / f"{_shard_name(k)}.npz") for k in range(len(records))]
    lengths = np.concatenate([m["lengths"] for m in per_shard])
    counts = [len(m["labels"]) for m in per_shard]
    # Byte offset of each image in its shard: the running sum of the lengths before it there.
    ends = np.concatenate([np.cumsum(m["lengths"]) for m in per_shard])
    labels = np.concatenate([m["labels"] for m in per_shard])
    index = dict(
        labels=labels,
        shard=np.repeat(np.arange(len(records), dtype=np.int32), counts),
        start=ends - lengths,
        length=lengths,
        source=np.concatenate([m["source"] for m in per_shard]),
        crc=np.concatenate([m["crc"] for m in per_shard]),
    )
    _write_atomic(folder / INDEX_NPZ, lambda f: np.savez(f, **index))
    bad = [tuple(b) for r in records for b in r["bad"]]
    lines = "".join(f"{path}\t{one_line(reason)}\n" for path, reason in bad)
    _write_atomic(folder / BAD_IMAGES, lambda f: f.write(lines.encode()))
    classes = getattr(source, "classes", None)
    num_classes = getattr(source, "num_classes", None)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if len(labels) else 0
    info = {
        **{k: settings[k] for k in ("version", "dataset", "split", "format", "image_size")},
        **{k: settings[k] for k in ("quality", "resize", "num_source")},
        "num_samples": len(labels),
        "num_bad": len(bad),
        "num_classes": int(num_classes),
        "classes": list(classes) if classes is not None else None,
        "shards": [f"{_shard_name(k)}.bin" for k in range(len(records))],
        "shard_checksums": [{"size": r["nbytes"], "crc32": r["crc32"]} for r in records],
        "index_checksum": file_record(folder / INDEX_NPZ),
    }
    info["fields_crc32"] = _fields_crc32(info)
    _write_json(folder / INDEX_JSON, info)  # last: its presence marks the split complete
    return len(labels), int(lengths.sum()), bad


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
    (``pycls.datasets.gpu_augment``). Attributes: ``format``, ``image_size`` (S), ``num_classes``,
    ``classes`` (or None), ``dataset`` (the source data set's name), ``labels``. A JPEG declaring
    more than ``max_pixels`` pixels is refused undecoded, wherever it would be decoded.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        split: str,
        decode: bool = True,
        skip_corrupt: bool = False,
        max_pixels: int = DEFAULT_MAX_PIXELS,
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
    problems = []
    for name, record in zip(info["shards"], records):
        try:
            verify_file(str(folder / name), record, "shard")
        except CorruptFileError as err:
            problems.append(str(err))
    return problems
