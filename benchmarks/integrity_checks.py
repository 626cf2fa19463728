#!/usr/bin/env python3
"""What the checks on data files cost, against reading the same data (BENCHMARKS.md: Integrity
checks on data files).

Writes one WebDataset tar shard and one parquet file of ``--images`` stand-in JPEGs (random bytes
of ``--image-bytes`` each: ImageNet's average JPEG is about 110 KB; the checks never decode),
then times, the contenders taking turns (pycls.core.timing.alternate):

- tar: indexing a shard (tarfile's walk, ``pycls.datasets.tar_shards.index_damaged``) and the
  check of its end alone (``_end_problem``: the bytes after the last member), against reading
  every sample of the shard once (one epoch);
- labels: ``labels.class_indices`` of a million integer labels (the tar index's check), and
  ``labels.arrow_class_indices`` of a parquet label column of a million rows;
- parquet: every row group's image column read through the checked file object (the
  declared sizes, then each page header in the bytes pyarrow reads) against plain pyarrow;
- a teacher's digest: SHA-256 of a ``--teacher-mb`` file, first and cached.

Files are read from the page cache (just written): the fastest a read can be, so the share the
checks take is the largest it can be. Times are this process's CPU time (``time.process_time``),
which the machine's other jobs do not inflate.

    OMP_NUM_THREADS=1 python benchmarks/integrity_checks.py --work /tmp/pycls_integrity_bench
"""

import argparse
import io
import os
import statistics
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from pycls.checkpoint import file_digest  # noqa: E402
from pycls.core import timing  # noqa: E402
from pycls.datasets import labels, parquet_bounds, remote_files, tar_shards  # noqa: E402
from pycls.datasets.parquet_shards import _chunks  # noqa: E402

# This process's CPU time: what the checks cost is CPU work, and so is a read from the page cache;
# the machine's other jobs do not inflate it as they do the wall clock
CLOCK = time.process_time


def _time(fn, iters=1, group=1):
    return timing.time_calls(fn, iters=iters, group=group, clock=CLOCK)


def write_data(work, images, image_bytes, group_rows):
    rng = np.random.default_rng(0)
    cells = [rng.bytes(image_bytes) for _ in range(images)]
    tar_path = os.path.join(work, "train-000000.tar")
    with tarfile.open(tar_path, "w") as tar:
        for n, data in enumerate(cells):
            for name, body in ((f"s{n:06d}.jpg", data), (f"s{n:06d}.cls", str(n % 1000).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    parquet_path = os.path.join(work, "train-00000-of-00001.parquet")
    classes = [n % 1000 for n in range(images)]
    table = pa.table({"image": pa.array(cells, pa.binary()), "label": classes})
    pq.write_table(table, parquet_path, row_group_size=group_rows)
    return tar_path, parquet_path


def tar_contenders(tar_path):
    size = os.path.getsize(tar_path)
    samples, _ = tar_shards.index_damaged(tar_path)
    reader = remote_files.RangeReader()
    ranges = [(row[2], row[3]) for row in samples]

    def index():
        return _time(lambda: tar_shards.index_damaged(tar_path), iters=3)

    def end_check():
        def check():
            with open(tar_path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
                for _ in tar:
                    pass
                end = tar.offset
                return end

        end = check()

        def only_the_end():
            with open(tar_path, "rb") as f:
                tar_shards._end_problem(f, end, size)

        return _time(only_the_end, iters=3, group=20)

    def epoch():
        return _time(lambda: reader.read_many(tar_path, ranges), iters=3)

    return {"tar: index the shard": index, "tar: check its end": end_check,
            "tar: read every sample": epoch}  # fmt: skip


def label_contenders(count):
    ints = [n % 1000 for n in range(count)]
    column = pa.array(ints, pa.int64())
    name_of = str  # only called on a refusal

    def tar_labels():
        return _time(lambda: labels.class_indices(ints, None, (1000, "x"), name_of), iters=3)

    def parquet_labels():
        return _time(
            lambda: labels.arrow_class_indices(column, None, (1000, "x"), name_of), iters=3
        )

    def unchecked():  # what the readers did before: a cast of the same values
        return _time(lambda: np.asarray(ints, dtype=np.int64), iters=3)

    return {"labels: tar's check": tar_labels, "labels: parquet's check": parquet_labels,
            "labels: a cast of the same list": unchecked}  # fmt: skip


def parquet_contenders(parquet_path):
    """Both read every row group's image column from a file opened anew (as each loader process
    does); the checked one through the file object that walks the page headers, after the
    declared sizes of each row group are checked."""
    meta = pq.ParquetFile(parquet_path).metadata
    groups, image = meta.num_row_groups, parquet_bounds.leaf_columns(meta, "image")

    def checked():
        def read_all():
            with open(parquet_path, "rb") as raw:
                f = parquet_bounds.CheckedFile(raw, parquet_path, 1 << 30)
                file = pq.ParquetFile(f)
                f.watch(_chunks(file.metadata))
                for g in range(groups):
                    parquet_bounds.check_read(file.metadata, parquet_path, [g], image, 1 << 30,
                                              100, image=image)  # fmt: skip
                    file.read_row_group(g, columns=["image"]).column(0).combine_chunks()

        return _time(read_all, iters=9)

    def plain():
        def read_all():
            with open(parquet_path, "rb") as f:
                file = pq.ParquetFile(f)
                for g in range(groups):
                    file.read_row_group(g, columns=["image"]).column(0).combine_chunks()

        return _time(read_all, iters=9)

    return {"parquet: read every row group, checked": checked,
            "parquet: the same with pyarrow alone": plain}  # fmt: skip


def digest_contenders(work, megabytes):
    path = os.path.join(work, "teacher.bin")
    with open(path, "wb") as f:
        block = np.random.default_rng(1).bytes(1 << 20)
        for _ in range(megabytes):
            f.write(block)
    cache = tempfile.mkdtemp(dir=work)

    def first():
        return _time(lambda: file_digest.digest(path, tempfile.mkdtemp(dir=work)))

    def cached():
        file_digest.digest(path, cache)
        return _time(lambda: file_digest.digest(path, cache), iters=3)

    return {"teacher digest: first": first, "teacher digest: cached": cached}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="a folder for the generated files")
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--image-bytes", type=int, default=110_000)
    parser.add_argument("--group-rows", type=int, default=100, help="parquet rows per group")
    parser.add_argument("--labels", type=int, default=1_000_000)
    parser.add_argument("--teacher-mb", type=int, default=334, help="RegNetY-16GF in fp32")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.work, exist_ok=True)
    tar_path, parquet_path = write_data(args.work, args.images, args.image_bytes, args.group_rows)
    contenders = {**tar_contenders(tar_path), **label_contenders(args.labels),
                  **parquet_contenders(parquet_path),
                  **digest_contenders(args.work, args.teacher_mb)}  # fmt: skip
    rounds = timing.alternate(contenders, args.rounds)
    print(f"\nrevision {timing.source_revision()}, load {rounds.load_range()}, "
          f"{args.images} images of {args.image_bytes} bytes, {args.rounds} rounds\n")  # fmt: skip
    print("| measured | median ms | per-round ratio to its reference (median, quartiles) |")
    print("|---|---|---|")
    refs = {"tar: check its end": "tar: read every sample",
            "tar: index the shard": "tar: read every sample",
            "labels: tar's check": "labels: a cast of the same list",
            "labels: parquet's check": "labels: a cast of the same list",
            "parquet: read every row group, checked": "parquet: the same with pyarrow alone",
            "teacher digest: cached": "teacher digest: first"}  # fmt: skip
    for name in contenders:
        median = statistics.median(t for r in rounds.times(name) for t in r) * 1e3
        ratio = ""
        if name in refs:
            r = rounds.ratio(name, refs[name])
            ratio = f"{r.of_medians:.4f} ({r.q1:.4f}-{r.q3:.4f}) of `{refs[name]}`"
        print(f"| {name} | {median:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
