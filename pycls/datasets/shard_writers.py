"""Writing a data set in the two conventions the field shares data in, readable without pycls:

- ``write_webdataset``: WebDataset tar shards ``OUT/SPLIT-000000.tar`` ..., each sample the
  members ``KEY.jpg`` (or ``.png`` / ``.webp``), ``KEY.cls`` (the class index) and ``KEY.json``
  (label and source file name), written with webdataset's own ``TarWriter``; ``OUT/_info.json``
  records each split's files and lengths as timm's ``wds/`` reader expects, and the classes.
- ``write_parquet``: Hugging Face datasets' layout, ``OUT/data/SPLIT-00000-of-00004.parquet``,
  columns ``image`` (the Image feature: a struct of ``bytes`` and ``path``) and ``label`` (a
  ClassLabel whose names the schema metadata records), written with pyarrow in row groups of
  100 rows (Hugging Face's own size for images).

The images are the source's file bytes unchanged (``encoding="original"``: an image folder at
its own size), or decoded (resized when ``size`` > 0: the shorter side to ``size``, then the
centre square, as the own shards do) and encoded as JPEG at ``quality`` or as PNG (exact pixels,
CIFAR's). Each file is written under a temporary name and renamed when complete; an image that
cannot be read is left out and listed (``WriteResult.bad``), with the reason, in
``OUT/bad_images_SPLIT.txt`` ("path<TAB>reason" per line, as the own shards' bad_images.txt).
``workers`` > 1 writes files in that many processes.
"""

import json
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision.io import encode_jpeg, encode_png

from pycls.datasets.decode import quiet
from pycls.datasets.imagefolder import CorruptImageError
from pycls.datasets.shards import resize_center_square
from pycls.errors import one_line, printable_path

ENCODINGS = ("jpeg", "png", "original")
INFO_JSON = "_info.json"
# Rows per parquet row group: what Hugging Face datasets writes for image data sets
PARQUET_ROW_GROUP = 100
_ORIGINAL_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
_TMP = ".tmp"


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


def _write_atomic(path: Path, write: Callable) -> None:
    tmp = path.with_name(path.name + _TMP)
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _samples_of(source, indices, size, encoding, quality, bad):
    for index in indices:
        try:
            yield index, *encode_sample(source, index, size, encoding, quality)
        except (CorruptImageError, OSError) as err:
            name = _source_file(source, index) or f"{type(source).__name__}[{index}]"
            bad.append((printable_path(name), one_line(str(err))))


def _tar_file(job) -> tuple[int, int, list]:
    k, source, path, indices, size, encoding, quality = job
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


def _parquet_file(job) -> tuple[int, int, list]:
    k, source, path, indices, size, encoding, quality, metadata = job
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


def _run(jobs, fn, workers, on_progress):
    results = {}
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            k, count, bad = fn(job)
            results[k] = (count, bad)
            if on_progress is not None:
                on_progress(count + len(bad))
        return results
    # fork: the workers inherit the source (file lists, CIFAR arrays) instead of rebuilding it
    with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
        for k, count, bad in pool.imap_unordered(fn, jobs):
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
    jobs = [
        (k, source, folder / n, r, size, encoding, quality)
        for k, (n, r) in enumerate(zip(names, ranges))
    ]
    results = _run(jobs, _tar_file, workers, on_progress)
    lengths = [results[k][0] for k in range(len(ranges))]
    bad = [b for k in range(len(ranges)) for b in results[k][1]]
    classes, num_classes = _classes(source)
    _record_split(folder / INFO_JSON, name or split, split, names, lengths, classes, num_classes)
    return WriteResult(folder, names, lengths, bad, _list_bad(folder, split, bad))


def _record_split(path, name, split, files, lengths, classes, num_classes):
    """Adds (or replaces) ``split`` in the _info.json at ``path`` (timm's format)."""
    info = {}
    if path.is_file():
        try:
            info = json.loads(path.read_text())
        except ValueError:
            info = {}
    info.setdefault("name", name)
    info.setdefault("splits", {})[split] = {
        "name": split,
        "num_samples": int(sum(lengths)),
        "filenames": list(files),
        "shard_lengths": [int(n) for n in lengths],
    }
    info["num_classes"], info["classes"] = num_classes, classes
    _write_atomic(path, lambda f: f.write(json.dumps(info, indent=1).encode()))


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
    metadata = hf_metadata(_classes(source)[0])
    jobs = [
        (k, source, folder / name, r, size, encoding, quality, metadata)
        for k, (name, r) in enumerate(zip(names, ranges))
    ]
    results = _run(jobs, _parquet_file, workers, on_progress)
    lengths = [results[k][0] for k in range(n)]
    bad = [b for k in range(n) for b in results[k][1]]
    files = [f"data/{name}" for name in names]
    return WriteResult(Path(out), files, lengths, bad, _list_bad(out, split, bad))
