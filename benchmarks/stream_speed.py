#!/usr/bin/env python3
"""Tar shards streamed over HTTP against the same tars on disk, and pycls's tar reader against
webdataset's and timm's on the same tars.

1. The loader: --num-images small JPEGs in tar shards of --shard-size, resized to --image-size
   (the quickstart's 16 px by default), the quickstart's batch (32) with --workers loader
   processes, DATA_LOADER.ORDER shards (what "auto" picks for a URL) and its default buffer.
   Read from disk, and from a file server on 127.0.0.1 in a process of its own: one that serves
   byte ranges (read whole and kept, the DATA_LOADER.READAHEAD_MB default; and by byte ranges
   alone, READAHEAD_MB 0) and Python's own http.server (no ranges). Images/s of a first epoch
   (loader processes started, nothing kept) and of the epochs after it, each cell measured in
   turn, round after round (--rounds), the order rotating.
2. One small range (1 KB) read again and again from the server with ranges, ms per request:
   as pycls asks (the kernel told to acknowledge the answer's first packet at once, Linux's
   TCP_QUICKACK) and without that (what a client gets by default).
3. The readers alone, one process (the work of one loader worker), decoding included, file
   order: pycls's TarShards (``load_many`` in batches of 64, decoded to uint8 tensors),
   webdataset's own ``WebDataset(urls).decode("torchrgb8")`` and timm's ``wds/`` reader
   (``timm.data.create_dataset("wds/NAME", ...)``, decoded to RGB PIL images).

    OMP_NUM_THREADS=1 python benchmarks/stream_speed.py --out /tmp/stream_speed.md

Prints markdown tables and writes them to --out.
"""

import argparse
import functools
import http.server
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pycls.core import timing  # noqa: E402
from pycls.datasets import AugmentedDataset, ImageFolder, build_transform, construct_loader  # noqa: E402
from pycls.datasets.formats import data_sources  # noqa: E402
from pycls.datasets.formats.tar_shards import TarShards, read_info  # noqa: E402
from pycls.datasets.formats.tar_writer import write_webdataset  # noqa: E402
from pycls.datasets.transport import http_files, remote_files  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", default="/tmp/pycls_stream_bench", help="scratch folder")
    parser.add_argument("--num-images", type=int, default=320)
    parser.add_argument("--source-size", type=int, nargs=2, default=(96, 128), help="H W")
    parser.add_argument("--shard-size", type=int, default=64, help="images per tar shard")
    parser.add_argument("--image-size", type=int, default=16, help="training image size")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2, help="epochs timed after the first")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="stream_speed.md")
    return parser.parse_args(argv)


def generate(root, num_images, size, classes=4, seed=0):
    """An image folder of smooth-noise JPEGs, written as tar shards (their very bytes)."""
    wds = root / "wds"
    if (wds / "_info.json").is_file():
        return wds
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        folder = root / "images" / "train" / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 256, (size[0] // 8, size[1] // 8, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize(size[::-1], Image.BICUBIC)
        image.save(folder / f"{i:05d}.jpg", quality=90)
    source = ImageFolder(root / "images", "train")
    return write_webdataset(source, wds, split="train", shard_size=args.shard_size,
                            encoding="original").folder  # fmt: skip


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Files with byte ranges on kept-alive connections, quietly."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.translate_path(self.path)
        if not os.path.isfile(path) or "Range" not in self.headers:
            return super().do_GET()
        size = os.path.getsize(path)
        first, last = self.headers["Range"][len("bytes=") :].split("-")
        start, end = int(first or 0), min(int(last) if last else size - 1, size - 1)
        self.send_response(206)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(start)
            self.wfile.write(f.read(end - start + 1))


class PlainHandler(http.server.SimpleHTTPRequestHandler):
    """Python's own file server (it answers a Range request with the whole file), quietly."""

    def log_message(self, *args):
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a loader worker that exits hangs up its kept-alive connection


def _serve(folder, handler, ports):
    server = QuietServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    ports.put(server.server_address[1])
    server.serve_forever()


def serve(folder, handler):
    """A file server of ``folder`` in a process of its own; returns (process, base URL)."""
    ports = multiprocessing.Queue()
    process = multiprocessing.Process(target=_serve, args=(folder, handler, ports), daemon=True)
    process.start()
    return process, f"http://127.0.0.1:{ports.get(timeout=30)}"


def loader_of(files, args, readahead_mb, index, workers=None):
    access = remote_files.Access(readahead_bytes=readahead_mb << 20)
    base = TarShards(files, cache_dir=index, access=access, window=8192)
    dataset = AugmentedDataset(base, functools.partial(build_transform, "none"), True)
    return construct_loader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
        num_workers=args.workers if workers is None else workers, pin_memory=False,
        persistent_workers=workers != 0, prefetch_factor=4 if workers != 0 else None,
        seed=0, image_size=args.image_size, order="shards", shuffle_buffer=8192,
    )  # fmt: skip


def one_epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return sum(len(labels) for _, labels, _ in loader)


def measure_loader(files, args, readahead_mb, index):
    """(images/s of the first epoch, of the epochs after it) of a loader built afresh, and of
    epochs after the first of one loading in this process (no workers: its CPU cost alone)."""

    def run():
        held, counted = {}, []

        def first():
            held["loader"] = loader_of(files, args, readahead_mb, index)
            counted.append(one_epoch(held["loader"], 0))

        def later():
            counted.append(one_epoch(held["loader"], len(counted)))

        cold = timing.time_calls(first).median
        warm = timing.time_calls(later, iters=1, group=args.epochs).median
        held.clear()  # the loader's workers stop before the next measurement
        held["loader"] = loader_of(files, args, readahead_mb, index, workers=0)
        alone = timing.time_calls(later, warmup=1, iters=1, group=args.epochs).median
        held.clear()
        return counted[0] / cold, counted[1] / warm, counted[-1] / alone

    return run


def reader_pycls(files, index):
    def run():
        shards = TarShards(files, cache_dir=index)
        n = len(shards)
        for start in range(0, n, 64):
            shards.load_many(list(range(start, min(n, start + 64))))
        return n

    return run


def reader_webdataset(files):
    import webdataset as wds  # what is compared

    def run():
        pipeline = wds.WebDataset(files, shardshuffle=False, empty_check=False).decode("torchrgb8")
        return sum(1 for sample in pipeline if sample["jpg"].shape[0] == 3)

    return run


def reader_timm(folder):
    from timm.data import create_dataset  # what is compared

    def run():
        dataset = create_dataset("wds/bench", root=str(folder), split="train")
        return sum(1 for image, _ in dataset if image.mode == "RGB")

    return run


def images_per_second(count_fn):
    def run():
        counted = []
        seconds = timing.time_calls(lambda: counted.append(count_fn())).median
        return counted[0] / seconds

    return run


def loader_table(args, wds, index):
    local = data_sources.split_files(str(wds), "train", "wds")
    ranged, ranged_url = serve(wds.parent, RangeHandler)
    plain, plain_url = serve(wds.parent, PlainHandler)
    try:
        ranged_files = data_sources.split_files(f"{ranged_url}/wds/", "train", "wds")
        plain_files = data_sources.split_files(f"{plain_url}/wds/", "train", "wds")
        cells = {
            "disk": measure_loader(local, args, 256, index),
            "HTTP with ranges, read whole (READAHEAD_MB 256)": measure_loader(
                ranged_files, args, 256, index),
            "HTTP with ranges, by byte ranges (READAHEAD_MB 0)": measure_loader(
                ranged_files, args, 0, index),
            "HTTP without ranges (Python's http.server)": measure_loader(
                plain_files, args, 256, index),
        }  # fmt: skip
        rounds = timing.alternate(
            cells, args.rounds, describe=lambda v: " / ".join(f"{x:.0f}" for x in v) + " images/s"
        )
    finally:
        ranged.kill()
        plain.kill()
    lines = [
        f"{args.num_images} JPEGs of {args.source_size[0]}x{args.source_size[1]} in tar shards of "
        f"{args.shard_size}, resized to {args.image_size} px, batch {args.batch_size}, "
        f"{args.workers} loader workers, DATA_LOADER.ORDER shards (buffer 8192); images/s, "
        f"median of {args.rounds} rounds (each cell once per round, the order rotating; load "
        f"average {rounds.load_range()}); ratio: the cell's time over disk's, per round, median "
        f"(quartiles). In one process: the same, loading in the training process (no workers, "
        f"epochs after the first), the pipeline's CPU cost alone. Revision "
        f"{timing.source_revision()}.",
        "",
        "| read from | first epoch | later epochs | in one process | first epoch vs disk | "
        "later epochs vs disk | in one process vs disk |",
        "|---|---|---|---|---|---|---|",
    ]
    disk = rounds.results["disk"]
    for name, results in rounds.results.items():
        columns = [[r[k] for r in results] for k in range(3)]
        ratios = [
            [d[k] / r[k] for d, r in zip(disk, results)] for k in range(3)
        ]  # disk images/s over the cell's: the cell's time over disk's
        cells = [f"{statistics.median(c):.0f}" for c in columns]
        cells += [f"{statistics.median(r):.2f}x ({_quartiles(r)})" for r in ratios]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _quartiles(values):
    q1, _, q3 = timing.quartiles(values)
    return f"{q1:.2f}-{q3:.2f}"


def _plain_send(conn, method, target, headers):
    conn.request(method, target, headers=headers)


def range_latency(url, quick):
    """Seconds per request of 50 reads of 1 KB through a fresh session."""

    def run():
        session = http_files.Session()
        send = http_files._send
        http_files._send = send if quick else _plain_send
        try:
            seconds = timing.time_calls(lambda: session.read_range(url, 100, 1024), iters=50)
        finally:
            http_files._send = send
        return seconds.median

    return run


def latency_table(args, wds):
    server, base = serve(wds.parent, RangeHandler)
    url = f"{base}/wds/{sorted(p.name for p in wds.glob('*.tar'))[0]}"
    try:
        cells = {"acknowledged at once (pycls)": range_latency(url, True),
                 "acknowledged when the kernel likes": range_latency(url, False)}  # fmt: skip
        rounds = timing.alternate(cells, args.rounds, describe=lambda v: f"{v * 1e3:.2f} ms")
    finally:
        server.kill()
    lines = [
        "",
        f"One range of 1 KB from the server with ranges (Python's http.server: headers and body "
        f"written separately), ms per request, median of 50 per round and of {args.rounds} "
        f"rounds (load average {rounds.load_range()}).",
        "",
        "| the answer's first packet | ms per range |",
        "|---|---|",
    ]
    for name, values in rounds.results.items():
        lines.append(f"| {name} | {statistics.median(values) * 1e3:.2f} |")
    return lines


def reader_table(args, wds, index):
    files = data_sources.split_files(str(wds), "train", "wds")
    assert read_info(str(wds / "_info.json"))  # timm's reader needs the split record
    cells = {
        "pycls TarShards": images_per_second(reader_pycls(files, index)),
        "webdataset WebDataset(...).decode('torchrgb8')": images_per_second(
            reader_webdataset(files)),
        "timm wds/ reader (PIL RGB)": images_per_second(reader_timm(wds)),
    }  # fmt: skip
    rounds = timing.alternate(cells, args.rounds, describe=lambda v: f"{v:.0f} images/s")
    ours = rounds.results["pycls TarShards"]
    lines = [
        "",
        f"The readers alone on the same tars from disk, one process, file order, decoding "
        f"included; images/s, median of {args.rounds} rounds (load average "
        f"{rounds.load_range()}); pycls over the other, per round, median (quartiles).",
        "",
        "| reader | images/s | pycls vs it |",
        "|---|---|---|",
    ]
    for name, speeds in rounds.results.items():
        ratio = [a / b for a, b in zip(ours, speeds)]
        cell = "-" if name == "pycls TarShards" else f"{statistics.median(ratio):.2f}x"
        cell += "" if name == "pycls TarShards" else f" ({_quartiles(ratio)})"
        lines.append(f"| {name} | {statistics.median(speeds):.0f} | {cell} |")
    return lines


def main(argv=None):
    global args
    args = parse_args(argv)
    torch.set_num_threads(1)
    work = Path(args.work)
    wds = generate(work, args.num_images, args.source_size)
    index = work / "tar_index"
    lines = loader_table(args, wds, index) + latency_table(args, wds)
    lines += reader_table(args, wds, index)
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    Path(args.out).write_text(table)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
