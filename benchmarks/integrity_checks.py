#!/usr/bin/env python3
"""What the checks on data files cost, against reading the same data (BENCHMARKS.md: Integrity
checks on data files).

Writes one WebDataset tar shard and one parquet file of ``--images`` stand-in JPEGs (random bytes
of ``--image-bytes`` each: ImageNet's average JPEG is about 110 KB; the checks never decode),
then times, the contenders taking turns (pycls.core.timing.alternate):

- tar: indexing a shard (tarfile's walk, ``pycls.datasets.formats.tar_index.index_damaged``) and
  the check of its end alone (``_end_problem``: the bytes after the last member), against reading
  every sample of the shard once (one epoch);
- labels: ``labels.class_indices`` of a million integer labels (the tar index's check), and
  ``labels.arrow_class_indices`` of a parquet label column of a million rows;
- parquet: every row group's image column read through the checked file object (the
  declared sizes, then each page header in the bytes pyarrow reads) against plain pyarrow;
- a teacher's digest: SHA-256 of a ``--teacher-mb`` file, first and cached;
- a shard that changes after indexing (DATA_LOADER.VERIFY_SHARDS): every sample of the tar
  shard read in random batches of ``--batch`` with its 512-byte header, the header's and the
  image's CRC-32 compared (``TarShards.encoded_many``, ``members``, the default), the header's
  only (``headers``), and without either (what the reader did before: the image's own range, no
  validator sent), from disk and from a file server on 127.0.0.1 in a process of its own that
  sends an ETag (each checked request then carries If-Match), by byte ranges; and the shard's
  SHA-256 (what ``sha256`` adds to each whole read of a shard) against reading every sample once;
- each read's deadline (``pycls.datasets.transport.read_deadlines``: the watch of each attempt, the
  bytes of each answer counted, the watchdog thread): the same HTTP batches with and without it;
- a parquet file's image paths held below its folder (``DATA_LOADER.IMAGE_PATHS below``: each
  path resolved, links followed) against read as given (``any``), every row's image read.

Files are read from the page cache (just written): the fastest a read can be, so the share the
checks take is the largest it can be. Times are this process's CPU time (``time.process_time``,
its fetching threads included), which the machine's other jobs do not inflate; the reads from
the server are also timed on the wall clock, what a loader waits.

    OMP_NUM_THREADS=1 python benchmarks/integrity_checks.py --work /tmp/pycls_integrity_bench
"""

import argparse
import contextlib
import functools
import hashlib
import http.client
import http.server
import io
import multiprocessing
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
from pycls.datasets.formats import labels, parquet_bounds, tar_index  # noqa: E402
from pycls.datasets.formats.parquet_shards import ParquetShards, _chunks  # noqa: E402
from pycls.datasets.formats.tar_shards import TarShards  # noqa: E402
from pycls.datasets.transport import read_deadlines, remote_files  # noqa: E402

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
    samples, _ = tar_index.index_damaged(tar_path)
    reader = remote_files.RangeReader()
    ranges = [(row[2], row[3]) for row in samples]

    def index():
        return _time(lambda: tar_index.index_damaged(tar_path), iters=3)

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
                tar_index._end_problem(f, end, size)

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


def linked_contenders(work, images, image_bytes):
    """A parquet file whose rows name their images by path (below its folder), read row by row
    with the paths held below the folder and as given."""
    rng = np.random.default_rng(2)
    folder = os.path.join(work, "linked", "images", "train")
    os.makedirs(folder, exist_ok=True)
    paths = []
    for n in range(images):
        path = os.path.join(folder, f"{n:06d}.jpg")
        with open(path, "wb") as f:
            f.write(rng.bytes(image_bytes))
        paths.append(f"images/train/{n:06d}.jpg")
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = pa.array([{"bytes": None, "path": p} for p in paths], kind)
    parquet_path = os.path.join(work, "linked", "train.parquet")
    pq.write_table(pa.table({"image": cells, "label": [n % 10 for n in range(images)]}),
                   parquet_path)  # fmt: skip

    def rows(rule):
        shards = ParquetShards([parquet_path], image_paths=rule)
        return lambda: _time(lambda: [shards.encoded(i) for i in range(len(shards))], iters=3)

    return {"parquet paths: held below the folder": rows("below"),
            "parquet paths: as given": rows("any")}  # fmt: skip


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


class ETagHandler(http.server.SimpleHTTPRequestHandler):
    """Byte ranges on kept-alive connections with an ETag (a digest of the file, once), If-Match
    answered, quietly: a server such as nginx or an object store."""

    protocol_version = "HTTP/1.1"
    tags: dict = {}

    def log_message(self, *args):
        pass

    def _tag(self, path):
        if path not in self.tags:
            with open(path, "rb") as f:
                self.tags[path] = '"' + hashlib.sha256(f.read()).hexdigest()[:16] + '"'
        return self.tags[path]

    def do_HEAD(self):
        self._answer(head=True)

    def do_GET(self):
        self._answer(head=False)

    def _answer(self, head):
        path = self.translate_path(self.path)
        tag, size = self._tag(path), os.path.getsize(path)
        if self.headers.get("If-Match", tag) != tag:
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = 0, size - 1
        ranged = "Range" in self.headers
        if ranged:
            first, last = self.headers["Range"][len("bytes=") :].split("-")
            start, end = int(first or 0), min(int(last) if last else size - 1, size - 1)
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("ETag", tag)
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if not head:
            with open(path, "rb") as f:
                f.seek(start)
                self.wfile.write(f.read(end - start + 1))


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass


def _serve(folder, ports):
    server = QuietServer(("127.0.0.1", 0), functools.partial(ETagHandler, directory=folder))
    ports.put(server.server_address[1])
    server.serve_forever()


def serve(folder):
    """The file server of ``folder`` in a process of its own: (process, base URL)."""
    ports = multiprocessing.Queue()
    process = multiprocessing.Process(target=_serve, args=(folder, ports), daemon=True)
    process.start()
    return process, f"http://127.0.0.1:{ports.get(timeout=30)}"


def _plain_reader(tars):
    """A reader of the same shards that sends no validator (what reads sent before)."""
    plain = remote_files.RangeReader(tars._reader.retries, tars._reader.access)
    plain.sizes, plain.whole_files = dict(tars._reader.sizes), tars._reader.whole_files
    return plain


def _unchecked(tars, indices, readers={}):  # noqa: B006 (one plain reader per TarShards)
    """What ``TarShards.encoded_many`` read before the header check: each image's own range,
    without a validator."""
    reader = readers.setdefault(id(tars), _plain_reader(tars))
    requests = []
    for i in indices:
        tars._check_size(i)
        shard = tars.shards[int(tars._shard[i])]
        start, size = int(tars._offset[i]), int(tars._size[i])
        requests.append((shard, start, size, f"member {tars._name(i)!r}"))
    return reader.read_batch(requests)


def verify_contenders(work, tar_path, url, batch):
    """Every sample in random batches, with its header and image read and compared, its header
    only, and neither."""
    local = TarShards([tar_path], cache_dir=os.path.join(work, "ix-local"))
    headers = TarShards([tar_path], cache_dir=os.path.join(work, "ix-local"), verify="headers")
    remote = TarShards([url], cache_dir=os.path.join(work, "ix-url"), window=0)
    remote_headers = TarShards([url], cache_dir=os.path.join(work, "ix-url"), window=0,
                               verify="headers")  # fmt: skip
    assert remote._reader.conditions[url] and not remote._reader.whole_files
    order = np.random.default_rng(0).permutation(len(local)).tolist()
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]

    def epoch(read, tars, clock=CLOCK):
        return lambda: timing.time_calls(lambda: [read(tars, b) for b in batches], iters=9,
                                         clock=clock)  # fmt: skip

    checked = lambda tars, b: tars.encoded_many(b)  # noqa: E731
    wall = time.perf_counter
    with open(tar_path, "rb") as f:
        shard = f.read()

    def digest():
        return _time(lambda: hashlib.sha256(shard).hexdigest(), iters=3)

    return {"verify: disk, members compared": epoch(checked, local),
            "verify: disk, headers compared": epoch(checked, headers),
            "verify: disk, as before": epoch(_unchecked, local),
            "verify: HTTP, members compared and If-Match": epoch(checked, remote),
            "verify: HTTP, headers compared and If-Match": epoch(checked, remote_headers),
            "verify: HTTP, as before": epoch(_unchecked, remote),
            "verify: HTTP wall, members compared and If-Match": epoch(checked, remote, wall),
            "verify: HTTP wall, as before": epoch(_unchecked, remote, wall),
            "verify: the shard's SHA-256": digest}  # fmt: skip


@contextlib.contextmanager
def _unwatched(watching, counted):
    """Reads as before their deadlines: no watch registered, answers not counted."""
    read_deadlines.watching = lambda: contextlib.nullcontext(read_deadlines.Watch())
    read_deadlines.CountedResponse = http.client.HTTPResponse
    try:
        yield
    finally:
        read_deadlines.watching, read_deadlines.CountedResponse = watching, counted


def deadline_contenders(work, url, batch):
    """The same HTTP batches (every sample once, headers and images compared) with each
    attempt watched and its answer counted, and without (a session of its own, whose
    connections were made without counting)."""
    watched = TarShards([url], cache_dir=os.path.join(work, "ix-url"), window=0)
    # Another window: another session, its connections made while the counting is off
    originals = (read_deadlines.watching, read_deadlines.CountedResponse)
    with _unwatched(*originals):
        plain = TarShards([url], cache_dir=os.path.join(work, "ix-url"), window=0,
                          access=remote_files.Access(read_timeout=59.0))  # fmt: skip
    order = np.random.default_rng(0).permutation(len(watched)).tolist()
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]

    def run(tars, unwatched):
        def epoch():
            with _unwatched(*originals) if unwatched else contextlib.nullcontext():
                return [tars.encoded_many(b) for b in batches]

        return lambda: timing.time_calls(epoch, iters=9, clock=CLOCK)

    return {"deadline: HTTP, each attempt watched": run(watched, False),
            "deadline: HTTP, unwatched": run(plain, True)}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="a folder for the generated files")
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--image-bytes", type=int, default=110_000)
    parser.add_argument("--group-rows", type=int, default=100, help="parquet rows per group")
    parser.add_argument("--labels", type=int, default=1_000_000)
    parser.add_argument("--teacher-mb", type=int, default=334, help="RegNetY-16GF in fp32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="samples a batch reads at once")
    parser.add_argument("--only", default="", help="comma-separated: only the contenders whose "
                        "names start so (e.g. 'verify,tar: read')")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.work, exist_ok=True)
    tar_path, parquet_path = write_data(args.work, args.images, args.image_bytes, args.group_rows)
    server, base = serve(args.work)
    url = f"{base}/{os.path.basename(tar_path)}"
    contenders = {**tar_contenders(tar_path), **label_contenders(args.labels),
                  **parquet_contenders(parquet_path),
                  **digest_contenders(args.work, args.teacher_mb),
                  **verify_contenders(args.work, tar_path, url, args.batch),
                  **deadline_contenders(args.work, url, args.batch),
                  **linked_contenders(args.work, args.images, args.image_bytes)}  # fmt: skip
    prefixes = tuple(args.only.split(","))
    contenders = {k: v for k, v in contenders.items() if k.startswith(prefixes)}
    os.sync()  # the files just written reach the disk before any read is timed
    try:
        rounds = timing.alternate(contenders, args.rounds)
    finally:
        server.terminate()
    print(f"\nrevision {timing.source_revision()}, load {rounds.load_range()}, "
          f"{args.images} images of {args.image_bytes} bytes, {args.rounds} rounds\n")  # fmt: skip
    print("| measured | median ms | per-round ratio to its reference (median, quartiles) |")
    print("|---|---|---|")
    refs = {"tar: check its end": "tar: read every sample",
            "tar: index the shard": "tar: read every sample",
            "labels: tar's check": "labels: a cast of the same list",
            "labels: parquet's check": "labels: a cast of the same list",
            "parquet: read every row group, checked": "parquet: the same with pyarrow alone",
            "teacher digest: cached": "teacher digest: first",
            "verify: disk, members compared": "verify: disk, as before",
            "verify: disk, headers compared": "verify: disk, as before",
            "verify: HTTP, members compared and If-Match": "verify: HTTP, as before",
            "verify: HTTP, headers compared and If-Match": "verify: HTTP, as before",
            "verify: HTTP wall, members compared and If-Match": "verify: HTTP wall, as before",
            "deadline: HTTP, each attempt watched": "deadline: HTTP, unwatched",
            "parquet paths: held below the folder": "parquet paths: as given",
            "verify: the shard's SHA-256": "tar: read every sample"}  # fmt: skip
    for name in contenders:
        median = statistics.median(t for r in rounds.times(name) for t in r) * 1e3
        ratio = ""
        if name in refs and refs[name] in contenders:
            r = rounds.ratio(name, refs[name])
            ratio = f"{r.of_medians:.4f} ({r.q1:.4f}-{r.q3:.4f}) of `{refs[name]}`"
        print(f"| {name} | {median:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
