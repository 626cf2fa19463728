"""The writer of Hugging Face parquet files (``pycls prepare --format parquet``):
``write_parquet``, datasets' layout ``OUT/data/SPLIT-00000-of-00004.parquet``, columns ``image``
(the Image feature: a struct of ``bytes`` and ``path``) and ``label`` (a ClassLabel whose names
the schema metadata records), written with pyarrow in row groups of 100 rows (Hugging Face's own
size for images); ``OUT/data/_info.json`` records each split's files
(``pycls.datasets.formats.split_index``).
"""

import json
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
# Rows per parquet row group: what Hugging Face datasets writes for image data sets
PARQUET_ROW_GROUP = 100


def _parquet_file(job, source) -> tuple[int, int, list]:
    k, path, indices, size, encoding, quality, metadata = job
    import pyarrow as pa  # optional (pip install pycls-vit[data]): parquet writing only
    import pyarrow.parquet as pq  # optional, as above

    bad, images, labels = [], [], []
    for _, data, ext, label, name in samples_of(source, indices, size, encoding, quality, bad):
        stem = os.path.splitext(name)[0]
        images.append({"bytes": data, "path": f"{stem}.{ext}"})
        labels.append(int(label))
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image_type), ("label", pa.int64())], metadata=metadata)
    table = pa.table(
        [pa.array(images, type=image_type), pa.array(labels, type=pa.int64())], schema=schema
    )
    with atomic_file(path, "wb") as f:
        pq.write_table(table, f, row_group_size=PARQUET_ROW_GROUP)
    return k, len(labels), bad


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
    check_settings(source, encoding, quality, shard_size, size)
    folder = Path(out) / "data"
    folder.mkdir(parents=True, exist_ok=True)
    ranges = split_jobs(len(source), shard_size)
    n = len(ranges)
    names = [f"{split}-{k:05d}-of-{n:05d}.parquet" for k in range(n)]
    own = rf"data/{re.escape(split)}-\d{{5}}-of-\d{{5}}\.parquet"
    earlier = split_index.earlier_files(Path(out), split, ".parquet", own)
    split_index.unrecord_if_replaced(folder / INFO_JSON, split, names)
    classes, num_classes = source_classes(source)
    metadata = hf_metadata(classes)
    jobs = [
        (k, folder / name, r, size, encoding, quality, metadata)
        for k, (name, r) in enumerate(zip(names, ranges))
    ]
    results = run_files(jobs, _parquet_file, workers, on_progress, source)
    lengths = [results[k][0] for k in range(n)]
    bad = [b for k in range(n) for b in results[k][1]]
    split_index.record_split(folder / INFO_JSON, split, split, names, lengths, classes, num_classes)
    split_index.remove_stale(earlier, names)
    files = [f"data/{name}" for name in names]
    return WriteResult(Path(out), files, lengths, bad, list_bad(out, split, bad))
