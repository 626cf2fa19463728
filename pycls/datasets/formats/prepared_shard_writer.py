"""The writer of pycls's own memory-mapped shards (DATA_LOADER.BACKEND shards; the format and
its reader are ``pycls.datasets.formats.prepared_shards``): ``prepare_split``, raw pixels or JPEG.

Restartable: each shard is written under a temporary name of its writer's own (``NAME.tmp.PID``,
``pycls.atomic_files``), read back and checked against the size and CRC32 it was written with,
renamed when complete, then recorded in the manifest; a rerun with the same settings removes what
killed writers left, skips recorded shards, and the result is byte-identical to an uninterrupted
run. The writing processes die with the preparation's own process (a kill of it, even SIGKILL,
leaves no orphan writing into the folder: ``shard_writing.in_processes``). Unreadable images are
recorded with their path and skipped, never fatal.
"""

import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import encode_jpeg

from pycls.atomic_files import atomic_file, write_text_atomic
from pycls.checkpoint.files import CorruptFileError, file_record, verify_file
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
from pycls.datasets.formats.shard_writing import in_processes, resize_center_square
from pycls.errors import EnvironmentFailure, one_line, printable_path

_TMP = ".tmp"  # NAME.tmp.PID: a file being written by process PID (NAME.tmp: by an older pycls)


def _read_back(expected: Callable[[], dict]) -> Callable[[str], None]:
    """The check of a shard before its rename: ``expected()``, the {"size", "crc32"} it was
    written with, held against the bytes read back (ShardWriteError otherwise, nothing
    renamed: the disk lost bytes without an error)."""

    def check(tmp: str) -> None:
        try:
            verify_file(str(tmp), expected(), "shard being written")
        except CorruptFileError as e:
            raise ShardWriteError(str(e)) from None

    return check


def _write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1))


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
    with atomic_file(folder / f"{name}.bin", "wb", check=_read_back(written)) as f:
        write_images(f)
    arrays = dict(
        labels=np.asarray(labels, dtype=np.int64),
        lengths=np.asarray(lengths, dtype=np.int64),
        source=np.asarray(sources, dtype=np.int64),
        crc=np.asarray(crcs, dtype=np.uint32),
    )
    with atomic_file(folder / f"{name}.npz", "wb") as f:
        np.savez(f, **arrays)
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
    for shard, record in in_processes(_numbered_shard, shards, workers, shared):
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
    with atomic_file(folder / INDEX_NPZ, "wb") as f:
        np.savez(f, **index)
    bad = [tuple(b) for r in records for b in r["bad"]]
    lines = "".join(f"{path}\t{one_line(reason)}\n" for path, reason in bad)
    with atomic_file(folder / BAD_IMAGES, "wb") as f:
        f.write(lines.encode())
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
