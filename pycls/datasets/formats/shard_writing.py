"""What every shard writer shares: the resize policy, the processes that write and die with the
preparation, and what the tar and parquet writers share (each sample encoded, the files' jobs,
the result and the list of bad images). The writers, one per format:
``prepared_shard_writer`` (pycls's own shards), ``tar_writer`` (WebDataset tars),
``parquet_writer`` (Hugging Face parquet files); each file is written through
``pycls.atomic_files`` (a temporary name, flushed, renamed when whole).

The tar and parquet images are the source's file bytes unchanged (``encoding="original"``: an
image folder at its own size), or decoded (resized when ``size`` > 0, as the own shards are:
``resize_center_square``) and encoded as JPEG at ``quality`` or as PNG (exact pixels, CIFAR's).
An image that cannot be read is left out and listed (``WriteResult.bad``), with the reason, in
``OUT/bad_images_SPLIT.txt`` ("path<TAB>reason" per line, as the own shards' bad_images.txt).
``workers`` > 1 writes files in that many processes.
"""

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision.io import encode_jpeg, encode_png
from torchvision.transforms.v2 import functional as TF

from pycls.atomic_files import atomic_file
from pycls.datasets.formats.decode import quiet
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.errors import one_line, printable_path

ENCODINGS = ("jpeg", "png", "original")
_ORIGINAL_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}


def resize_center_square(image: torch.Tensor, size: int) -> torch.Tensor:
    """The shorter side to ``size`` (bilinear, antialiased), then the centre size x size square."""
    image = TF.resize(image, [size], antialias=True)
    return TF.center_crop(image, [size, size]).contiguous()


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


def in_processes(work: Callable, items: list, workers: int, shared: dict):
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


def list_bad(out, split, bad) -> Path:
    """Writes the split's list of bad images (empty when there are none: a rerun replaces it)."""
    path = bad_images_file(out, split)
    lines = "".join(f"{name}\t{reason}\n" for name, reason in bad)
    with atomic_file(path, "wb") as f:
        f.write(lines.encode())
    return path


def source_classes(source: Dataset) -> tuple[list[str], int]:
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


def check_settings(source, encoding, quality, shard_size, size):
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


def samples_of(source, indices, size, encoding, quality, bad):
    for index in indices:
        try:
            yield index, *encode_sample(source, index, size, encoding, quality)
        except (CorruptImageError, OSError) as err:
            name = _source_file(source, index) or f"{type(source).__name__}[{index}]"
            bad.append((printable_path(name), one_line(str(err))))


def run_files(jobs, fn, workers, on_progress, source):
    results = {}
    for k, count, bad in in_processes(fn, jobs, workers, {"source": source}):
        results[k] = (count, bad)
        if on_progress is not None:
            on_progress(count + len(bad))
    return results


def split_jobs(n, shard_size):
    return [range(k * shard_size, min((k + 1) * shard_size, n)) for k in range(-(-n // shard_size))]
