"""The writer of WebDataset tar shards (``pycls prepare --format wds``): ``write_webdataset``,
``OUT/SPLIT-000000.tar`` ..., each sample the members ``KEY.jpg`` (or ``.png`` / ``.webp``),
``KEY.cls`` (the class index) and ``KEY.json`` (label and source file name), written with
webdataset's own ``TarWriter``; ``OUT/_info.json`` records each split's files and lengths as
timm's ``wds/`` reader expects, and the classes (``pycls.datasets.formats.split_index``).
"""

import os
import re
from collections.abc import Callable
from pathlib import Path

from torch.utils.data import Dataset

from pycls.atomic_files import atomic_file
from pycls.datasets.formats import split_index
from pycls.datasets.formats.shard_writing import (
    WriteResult,
    check_settings,
    list_bad,
    run_files,
    samples_of,
    source_classes,
    split_jobs,
)

INFO_JSON = split_index.INFO_JSON


def _tar_file(job, source) -> tuple[int, int, list]:
    k, path, indices, size, encoding, quality = job
    from webdataset import TarWriter  # optional (pip install pycls-vit[data]): tar writing only

    bad, count = [], 0

    def write(f):
        nonlocal count
        # mtime 0: the same images give the same bytes, whenever written
        with TarWriter(f, mtime=0) as tar:
            for index, data, ext, label, name in samples_of(
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

    with atomic_file(path, "wb") as f:
        write(f)
    return k, count, bad


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
    check_settings(source, encoding, quality, shard_size, size)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    ranges = split_jobs(len(source), shard_size)
    names = [f"{split}-{k:06d}.tar" for k in range(len(ranges))]
    own = rf"{re.escape(split)}-\d{{6}}\.tar"
    earlier = split_index.earlier_files(folder, split, ".tar", own)
    split_index.unrecord_if_replaced(folder / INFO_JSON, split, names)
    jobs = [
        (k, folder / n, r, size, encoding, quality) for k, (n, r) in enumerate(zip(names, ranges))
    ]
    results = run_files(jobs, _tar_file, workers, on_progress, source)
    lengths = [results[k][0] for k in range(len(ranges))]
    bad = [b for k in range(len(ranges)) for b in results[k][1]]
    classes, num_classes = source_classes(source)
    split_index.record_split(
        folder / INFO_JSON, name or split, split, names, lengths, classes, num_classes
    )
    split_index.remove_stale(earlier, names)
    return WriteResult(folder, names, lengths, bad, list_bad(folder, split, bad))
