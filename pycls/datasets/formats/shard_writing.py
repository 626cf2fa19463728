"""Every shard writer: a data set written once into files to train from. (Over the house's 600
lines on purpose: one module for every format's writer, which share the resize policy, the atomic
files and the worker processes that die with the preparation.)

- ``prepare_split``: pycls's own memory-mapped shards (DATA_LOADER.BACKEND shards; the format and
  its reader are ``pycls.datasets.formats.prepared_shards``): raw pixels or JPEG. Restartable: each
  shard is written under a temporary name of its writer's own (``NAME.tmp.PID``), read back and
  checked against the size and CRC32 it was written with, renamed when complete, then recorded in
  the manifest; a rerun with the same settings removes what killed writers left, skips recorded
  shards, and the result is byte-identical to an uninterrupted run. The writing processes die with
  the preparation's own process (a kill of it, even SIGKILL, leaves no orphan writing into the
  folder). Unreadable images are recorded with their path and skipped, never fatal.
- ``write_webdataset``: WebDataset tar shards ``OUT/SPLIT-000000.tar`` ..., each sample the
  members ``KEY.jpg`` (or ``.png`` / ``.webp``), ``KEY.cls`` (the class index) and ``KEY.json``
  (label and source file name), written with webdataset's own ``TarWriter``; ``OUT/_info.json``
  records each split's files and lengths as timm's ``wds/`` reader expects, and the classes.
- ``write_parquet``: Hugging Face datasets' layout, ``OUT/data/SPLIT-00000-of-00004.parquet``,
  columns ``image`` (the Image feature: a struct of ``bytes`` and ``path``) and ``label`` (a
  ClassLabel whose names the schema metadata records), written with pyarrow in row groups of
  100 rows (Hugging Face's own size for images).

The tar and parquet images are the source's file bytes unchanged (``encoding="original"``: an
image folder at its own size), or decoded (resized when ``size`` > 0, as the own shards are:
``resize_center_square``) and encoded as JPEG at ``quality`` or as PNG (exact pixels, CIFAR's).
Each file is written under a temporary name and renamed when complete; an image that cannot be
read is left out and listed (``WriteResult.bad``), with the reason, in ``OUT/bad_images_SPLIT.txt``
("path<TAB>reason" per line, as the own shards' bad_images.txt). ``workers`` > 1 writes files in
that many processes.
"""

import ctypes
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import encode_jpeg, encode_png
from torchvision.transforms.v2 import functional as TF

from pycls.checkpoint.files import CorruptFileError, file_record, verify_file
from pycls.datasets.formats import split_index
from pycls.datasets.formats.decode import quiet
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.formats.prepared_shards import (
    BAD_IMAGES,
    FORMAT_VERSION,
    FORMATS,
    INDEX_JSON,
    INDEX_NPZ,
    MANIFEST,
    _fields_crc32,
    _load_npz,
    unlisted_shards,
)
from pycls.errors import EnvironmentFailure, one_line, printable_path

ENCODINGS = ("jpeg", "png", "original")
INFO_JSON = split_index.INFO_JSON
# Rows per parquet row group: what Hugging Face datasets writes for image data sets
PARQUET_ROW_GROUP = 100
_ORIGINAL_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
_TMP = ".tmp"  # NAME.tmp.PID: a file being written by process PID (NAME.tmp: by an older pycls)


# ------------------------------------------------------------------------------------------------ #
# What every writer shares: the resize policy, atomic files, worker processes
# ------------------------------------------------------------------------------------------------ #


def resize_center_square(image: torch.Tensor, size: int) -> torch.Tensor:
    """The shorter side to ``size`` (bilinear, antialiased), then the centre size x size square."""
    image = TF.resize(image, [size], antialias=True)
    return TF.center_crop(image, [size, size]).contiguous()


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


# A pool worker's work and the arguments every item shares (set once per worker by _init_worker)
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


def _init_worker(parent_pid: int, work: Callable, shared: dict) -> None:
    die_with_parent(parent_pid)
    torch.set_num_threads(1)  # one image at a time per process; the pool is the parallelism
    _WORKER.update(work=work, shared=shared)


def _work_in_worker(item):
    return _WORKER["work"](item, **_WORKER["shared"])


def _in_processes(work: Callable, items: list, workers: int, shared: dict):
    """Yields ``work(item, **shared)`` for every item, in this process or (``workers`` > 1) in
    that many processes as each finishes. They fork, so they inherit ``shared`` (the source: file
    lists, CIFAR arrays) instead of a pickled copy per item, and die with this process."""
    if workers <= 1 or len(items) <= 1:
        for item in items:
            yield work(item, **shared)
        return
    context = multiprocessing.get_context("fork")
    initargs = (os.getpid(), work, shared)
    with context.Pool(min(workers, len(items)), _init_worker, initargs) as pool:
        yield from pool.imap_unordered(_work_in_worker, items)


# ------------------------------------------------------------------------------------------------ #
# pycls's own shards (DATA_LOADER.BACKEND shards; the format:
# pycls.datasets.formats.prepared_shards)
# ------------------------------------------------------------------------------------------------ #


# Default images per shard: about 1 GiB of raw pixels, or this many JPEGs (~0.2-0.3 GB at 256 px).
_RAW_SHARD_BYTES = 1 << 30
_JPEG_SHARD_IMAGES = 8192


def _encode(image: torch.Tensor, fmt: str, quality: int) -> np.ndarray:
    if fmt == "raw":
        return image.numpy().reshape(-1)
    return quiet(encode_jpeg, image, quality=quality).numpy()


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


def _numbered_shard(shard, source, folder, settings, on_image=None) -> tuple[int, dict]:
    return shard, write_shard(source, folder, shard, settings, on_image)


def _run_shards(source, folder, settings, shards, workers, on_progress):
    """Writes ``shards``, yielding (shard, record) as each is finished."""
    pooled = workers > 1 and len(shards) > 1
    # Workers cannot call back: whole shards are counted as they finish
    on_image = (lambda: on_progress(1)) if on_progress is not None and not pooled else None
    shared = dict(source=source, folder=folder, settings=settings, on_image=on_image)
    for shard, record in _in_processes(_numbered_shard, shards, workers, shared):
        if pooled and on_progress is not None:
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


def _refuse_foreign_shards(folder: Path, num_shards: int) -> None:
    """A shard file beyond this preparation's would sit in the split's folder unlisted (the
    reader refuses it): refused now, before anything is written."""
    extra = unlisted_shards(folder, [f"{_shard_name(k)}.bin" for k in range(num_shards)])
    if extra:
        raise ValueError(
            f"{folder / extra[0]} is not a shard of this preparation ({num_shards} shards): "
            "remove it, or write elsewhere"
        )


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
    _refuse_foreign_shards(folder, num_shards)
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
# WebDataset tar shards and Hugging Face parquet files
# ------------------------------------------------------------------------------------------------ #


@dataclass
class WriteResult:
    """What a writer did: the files it wrote (relative to ``folder``), per-file sample counts,
    the images left out with the reason, and the file that lists them."""

    folder: Path
    files: list[str]
    lengths: list[int]
    bad: list[tuple[str, str]] = field(default_factory=list)
    bad_list: Path | None = None

    @property
    def num_samples(self) -> int:
        return sum(self.lengths)

    def summary(self) -> str:
        listed = f", listed in {self.bad_list}" if self.bad and self.bad_list else ""
        return (
            f"{self.folder}: {self.num_samples} images in {len(self.files)} file(s) "
            f"({self.files[0]} ...); {len(self.bad)} bad image(s){listed}"
        )


def bad_images_file(out: str | os.PathLike, split: str) -> Path:
    """Where a split's bad images are listed: OUT/bad_images_SPLIT.txt."""
    return Path(out) / f"bad_images_{split}.txt"


def _list_bad(out, split, bad) -> Path:
    """Writes the split's list of bad images (empty when there are none: a rerun replaces it)."""
    path = bad_images_file(out, split)
    lines = "".join(f"{name}\t{reason}\n" for name, reason in bad)
    _write_atomic(path, lambda f: f.write(lines.encode()))
    return path


def _classes(source: Dataset) -> tuple[list[str], int]:
    classes = getattr(source, "classes", None)
    num = getattr(source, "num_classes", None)
    if num is None:
        labels = getattr(source, "labels", None)
        num = int(torch.as_tensor(labels).max()) + 1 if labels is not None else 0
    names = list(classes) if classes is not None else [str(k) for k in range(num)]
    return names, len(names)


def _source_file(source: Dataset, index: int) -> str | None:
    samples = getattr(source, "samples", None)
    return str(samples[index][0]) if samples is not None else None


def encode_sample(source: Dataset, index: int, size: int, encoding: str, quality: int):
    """(image bytes, extension, label, source name) of sample ``index``; raises
    CorruptImageError or OSError for an image that cannot be read."""
    path = _source_file(source, index)
    name = os.path.basename(path) if path else f"{type(source).__name__}[{index}]"
    if encoding == "original" and path and size == 0:
        ext = _ORIGINAL_EXTENSIONS.get(os.path.splitext(path)[1].lower())
        if ext is not None:
            source[index]  # decodes: a file that does not is left out, as the others are
            with open(path, "rb") as f:
                return f.read(), ext, int(source.labels[index]), name
    image, label = source[index]
    if size > 0:
        image = resize_center_square(image, size)
    if encoding == "jpeg":
        return quiet(encode_jpeg, image, quality=quality).numpy().tobytes(), "jpg", label, name
    return quiet(encode_png, image).numpy().tobytes(), "png", int(label), name


def _check(source, encoding, quality, shard_size, size):
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown image encoding {encoding!r}; expected one of {ENCODINGS}")
    if encoding == "original" and (size or getattr(source, "samples", None) is None):
        raise ValueError(
            "encoding 'original' keeps an image folder's file bytes as they are: it needs an "
            "image folder and size 0 (use jpeg or png to resize or to write CIFAR)"
        )
    if not 1 <= quality <= 100 or shard_size < 1 or size < 0:
        raise ValueError(
            f"quality must be in [1, 100], shard_size > 0 and size >= 0; got {quality}, "
            f"{shard_size} and {size}"
        )
    if len(source) == 0:
        raise ValueError("the source holds no images")


def _samples_of(source, indices, size, encoding, quality, bad):
    for index in indices:
        try:
            yield index, *encode_sample(source, index, size, encoding, quality)
        except (CorruptImageError, OSError) as err:
            name = _source_file(source, index) or f"{type(source).__name__}[{index}]"
            bad.append((printable_path(name), one_line(str(err))))


def _tar_file(job, source) -> tuple[int, int, list]:
    k, path, indices, size, encoding, quality = job
    from webdataset import TarWriter  # optional (pip install pycls-vit[data]): tar writing only

    bad, count = [], 0

    def write(f):
        nonlocal count
        # mtime 0: the same images give the same bytes, whenever written
        with TarWriter(f, mtime=0) as tar:
            for index, data, ext, label, name in _samples_of(
                source, indices, size, encoding, quality, bad
            ):
                tar.write(
                    {
                        "__key__": f"{index:08d}",
                        ext: data,
                        "cls": int(label),
                        "json": {"label": int(label), "filename": name},
                    }
                )
                count += 1

    _write_atomic(path, write)
    return k, count, bad


def _parquet_file(job, source) -> tuple[int, int, list]:
    k, path, indices, size, encoding, quality, metadata = job
    import pyarrow as pa  # optional (pip install pycls-vit[data]): parquet writing only
    import pyarrow.parquet as pq  # optional, as above

    bad, images, labels = [], [], []
    for _, data, ext, label, name in _samples_of(source, indices, size, encoding, quality, bad):
        stem = os.path.splitext(name)[0]
        images.append({"bytes": data, "path": f"{stem}.{ext}"})
        labels.append(int(label))
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image_type), ("label", pa.int64())], metadata=metadata)
    table = pa.table(
        [pa.array(images, type=image_type), pa.array(labels, type=pa.int64())], schema=schema
    )
    _write_atomic(path, lambda f: pq.write_table(table, f, row_group_size=PARQUET_ROW_GROUP))
    return k, len(labels), bad


def _run(jobs, fn, workers, on_progress, source):
    results = {}
    for k, count, bad in _in_processes(fn, jobs, workers, {"source": source}):
        results[k] = (count, bad)
        if on_progress is not None:
            on_progress(count + len(bad))
    return results


def _split_jobs(n, shard_size):
    return [range(k * shard_size, min((k + 1) * shard_size, n)) for k in range(-(-n // shard_size))]


def write_webdataset(
    source: Dataset,
    out: str | os.PathLike,
    *,
    split: str,
    shard_size: int = 1000,
    size: int = 0,
    encoding: str = "jpeg",
    quality: int = 90,
    workers: int = 0,
    name: str = "",
    on_progress: Callable[[int], None] | None = None,
) -> WriteResult:
    """Write ``source`` (``(uint8 (3, H, W), label)`` samples; an ImageFolder for "original")
    as WebDataset tar shards ``out/SPLIT-NNNNNN.tar`` and record the split in
    ``out/_info.json``."""
    _check(source, encoding, quality, shard_size, size)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ranges = _split_jobs(len(source), shard_size)
    names = [f"{split}-{k:06d}.tar" for k in range(len(ranges))]
    own = rf"{re.escape(split)}-\d{{6}}\.tar"
    earlier = split_index.earlier_files(folder, split, ".tar", own)
    split_index.unrecord_if_replaced(folder / INFO_JSON, split, names)
    jobs = [
        (k, folder / n, r, size, encoding, quality) for k, (n, r) in enumerate(zip(names, ranges))
    ]
    results = _run(jobs, _tar_file, workers, on_progress, source)
    lengths = [results[k][0] for k in range(len(ranges))]
    bad = [b for k in range(len(ranges)) for b in results[k][1]]
    classes, num_classes = _classes(source)
    split_index.record_split(
        folder / INFO_JSON, name or split, split, names, lengths, classes, num_classes
    )
    split_index.remove_stale(earlier, names)
    return WriteResult(folder, names, lengths, bad, _list_bad(folder, split, bad))


def hf_metadata(classes: list[str]) -> dict[bytes, bytes]:
    """The ``huggingface`` schema metadata of an image + ClassLabel table, as datasets writes
    it: datasets.load_dataset gives the columns back as Image and ClassLabel features."""
    features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def write_parquet(
    source: Dataset,
    out: str | os.PathLike,
    *,
    split: str,
    shard_size: int = 1000,
    size: int = 0,
    encoding: str = "jpeg",
    quality: int = 90,
    workers: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> WriteResult:
    """Write ``source`` as parquet files ``out/data/SPLIT-NNNNN-of-MMMMM.parquet`` (Hugging Face
    datasets' layout and features)."""
    _check(source, encoding, quality, shard_size, size)
    folder = Path(out) / "data"
    folder.mkdir(parents=True, exist_ok=True)
    ranges = _split_jobs(len(source), shard_size)
    n = len(ranges)
    names = [f"{split}-{k:05d}-of-{n:05d}.parquet" for k in range(n)]
    own = rf"data/{re.escape(split)}-\d{{5}}-of-\d{{5}}\.parquet"
    earlier = split_index.earlier_files(Path(out), split, ".parquet", own)
    split_index.unrecord_if_replaced(folder / INFO_JSON, split, names)
    classes, num_classes = _classes(source)
    metadata = hf_metadata(classes)
    jobs = [
        (k, folder / name, r, size, encoding, quality, metadata)
        for k, (name, r) in enumerate(zip(names, ranges))
    ]
    results = _run(jobs, _parquet_file, workers, on_progress, source)
    lengths = [results[k][0] for k in range(n)]
    bad = [b for k in range(n) for b in results[k][1]]
    split_index.record_split(folder / INFO_JSON, split, split, names, lengths, classes, num_classes)
    split_index.remove_stale(earlier, names)
    files = [f"data/{name}" for name in names]
    return WriteResult(Path(out), files, lengths, bad, _list_bad(out, split, bad))
