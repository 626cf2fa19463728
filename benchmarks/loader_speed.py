#!/usr/bin/env python3
"""Data-loader throughput (images/s through to normalised batches on the device) for:

- an image folder of JPEGs, decoded and augmented per sample by torchvision on the CPU workers;
- shards (raw pixels or JPEG), augmented per sample on the CPU workers;
- raw shards, augmented in whole batches by the GPU path's code running on the CPU (its fallback);
- shards (raw or JPEG) augmented, and for JPEG decoded, on the GPU (when CUDA is present);
- WebDataset tar shards and Hugging Face parquet files holding the own JPEG shards' very bytes
  (the same resize and quality), read from disk and through a local HTTP server on 127.0.0.1
  (each in the epoch order DATA_LOADER.ORDER auto picks for it); with --no-formats, not;

all with the ImageNet training preset (random resized crop + flip) at --image-size, for each
worker count in --workers, the cells taking turns round after round (--repeats rounds, the
order rotating, the load average of each round stated); then the image decoders alone
(torchvision, and TorchCodec where installed; on the CPU, and nvJPEG batches on CUDA). Without
--data it generates an image folder of smooth-noise JPEGs.

    python benchmarks/loader_speed.py --workers 1 2 --out /tmp/loader_bench.md

Prints a markdown table and writes it to --out.
"""

import argparse
import functools
import http.server
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pycls.core import timing  # noqa: E402
from pycls.datasets import (  # noqa: E402
    DATASET_STATS,
    AugmentedDataset,
    DeviceBatches,
    ImageFolder,
    build_transform,
    construct_loader,
)
from pycls.datasets.formats import data_sources, decode  # noqa: E402
from pycls.datasets.formats.imagefolder import read_image_bytes  # noqa: E402
from pycls.datasets.formats.parquet_shards import ParquetShards  # noqa: E402
from pycls.datasets.formats.parquet_writer import write_parquet  # noqa: E402
from pycls.datasets.formats.prepared_shard_writer import prepare_split  # noqa: E402
from pycls.datasets.formats.prepared_shards import ShardDataset  # noqa: E402
from pycls.datasets.formats.tar_shards import TarShards  # noqa: E402
from pycls.datasets.formats.tar_writer import write_webdataset  # noqa: E402
from pycls.datasets.loading.gpu_augment import (  # noqa: E402
    DeviceAugment,
    DeviceAugmentBatches,
    DeviceAugmentDataset,
    construct_device_loader,
)


def parse_args(argv=None):
    # The whole docstring: its first paragraph alone stops mid-sentence
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", help="image folder root with a train/ split (default: generate)")
    parser.add_argument("--work", default="/tmp/pycls_loader_bench", help="scratch folder")
    parser.add_argument("--num-images", type=int, default=512, help="images to generate")
    parser.add_argument("--source-size", type=int, nargs=2, default=(300, 400), help="H W")
    parser.add_argument("--stored-size", type=int, default=256, help="shard image side")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the shards")
    parser.add_argument("--image-size", type=int, default=224, help="training image size")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="measurements per cell; the best is reported "
        "(on a shared machine the others are slowed by other processes)",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="loader_benchmark.md", help="markdown table written here")
    parser.add_argument(
        "--no-formats",
        dest="formats",
        action="store_false",
        help="leave out the WebDataset, parquet and HTTP rows",
    )
    return parser.parse_args(argv)


def smooth_noise(rng, height, width):
    """A natural-looking uint8 (H, W, 3) image: noise at four scales, upsampled and summed."""
    image = torch.zeros(1, 3, height, width)
    for octave in range(2, 6):
        coarse = torch.from_numpy(rng.standard_normal((1, 3, 2**octave, 2**octave), np.float32))
        image += torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic")
    image = (image - image.mean()) / image.std() * 50 + 128
    return image[0].clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def generate_image_folder(root, num_images, size, classes=8, seed=0):
    done = root / "train" / ".complete"
    if done.is_file():
        return
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        folder = root / "train" / f"class{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(smooth_noise(rng, *size)).save(folder / f"{i:05d}.jpg", quality=90)
    done.touch()


def folder_mib(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def loader_options(args, workers, order="global"):
    return dict(
        order=order,
        shuffle_buffer=8192,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=True,
        persistent_workers=True,
        prefetch_factor=4,
        seed=0,
        image_size=args.image_size,
    )


def epoch_runner(batches, loader):
    """A callable running the next epoch through the loader; ``counted`` holds each epoch's
    images."""
    counted = []

    def run():
        loader.sampler.set_epoch(len(counted))
        counted.append(sum(len(labels) for _, labels, _ in batches))

    return run, counted


def images_per_second(batches, loader, epochs, device):
    """Throughput over ``epochs`` after one untimed epoch (worker start-up, page cache)."""
    run, counted = epoch_runner(batches, loader)
    seconds = timing.time_calls(run, device, warmup=1, iters=1, group=epochs).median
    return sum(counted[1:]) / (seconds * epochs)


def cpu_ms_per_image(row, args):
    """A callable measuring once the CPU time per image of one pipeline run entirely in this
    process on one thread (no worker processes): load, decode, augment, collate and normalise,
    over one epoch of a freshly built loader. The process clock (``time.process_time``: every
    thread of this process, the HTTP rows' local server included) is what the work costs; other
    processes' load delays it but does not add to it, unlike the wall clock."""

    def run():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            batches, loader = row.build(row.base(), args, 0, torch.device("cpu"))
            epoch, counted = epoch_runner(batches, loader)
            watch = timing.Stopwatch(whole_process=True)
            epoch()
            return watch.cpu() / counted[0] * 1e3
        finally:
            torch.set_num_threads(threads)

    return run


def per_sample_pipeline(base, args, workers, device, order="global"):
    mean, std = DATASET_STATS["imagefolder"]
    factory = functools.partial(build_transform, "imagenet")
    dataset = AugmentedDataset(base, factory, True)
    loader = construct_loader(dataset, **loader_options(args, workers, order))
    return DeviceBatches(loader, device, mean, std), loader


def shard_order_pipeline(base, args, workers, device):
    """DATA_LOADER.ORDER shards: the order auto picks for parquet and for URLs."""
    return per_sample_pipeline(base, args, workers, device, order="shards")


def batched_pipeline(base, args, workers, device):
    mean, std = DATASET_STATS["imagefolder"]
    dataset = DeviceAugmentDataset(base, DeviceAugment("imagenet", True), True)
    loader = construct_device_loader(dataset, **loader_options(args, workers))
    return DeviceAugmentBatches(loader, device, mean, std, dataset.augment), loader


class Pipeline(NamedTuple):
    data: str  # also the key of the on-disk size
    where: str  # where decoding and augmentation run
    base: Callable  # () -> raw dataset
    build: Callable  # (base, args, workers, device) -> (batches, loader)
    device: str


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Files with byte ranges (fsspec reads a URL's samples as ranges), quietly."""

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


def serve(folder):
    """A threaded HTTP server of ``folder`` on 127.0.0.1 (a free port); returns its base URL."""
    handler = functools.partial(RangeHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def write_formats(source, work, args):
    """The source as WebDataset tars and parquet files holding the own JPEG shards' bytes."""
    folder = work / f"formats{args.stored_size}"
    for name, write in (("wds", write_webdataset), ("parquet", write_parquet)):
        done = folder / name / ".complete"
        if not done.is_file():
            result = write(source, folder / name, split="train", shard_size=256,
                           size=args.stored_size, encoding="jpeg", quality=args.quality,
                           workers=max(args.workers))  # fmt: skip
            print(result.summary(), flush=True)
            done.touch()
    return folder


def format_rows(folder, url, index):
    """WebDataset and parquet rows, from disk and from ``url`` (the same files served)."""
    where = "CPU workers: decode + torchvision"
    rows = []
    for label, root in (("", str(folder)), (", HTTP", f"{url}")):
        tars = data_sources.split_files(f"{root}/wds/", "train", "wds")
        parquet = data_sources.split_files(f"{root}/parquet/", "train", "parquet")
        remote = root.startswith("http")
        rows += [
            Pipeline(f"WebDataset tars{label}", where,
                     functools.partial(TarShards, tars, cache_dir=index),
                     shard_order_pipeline if remote else per_sample_pipeline, "cpu"),
            Pipeline(f"parquet{label}", where, functools.partial(ParquetShards, parquet),
                     shard_order_pipeline, "cpu"),
        ]  # fmt: skip
    return rows


def pipelines(data, shards, cuda):
    """Every configuration measured; the per-sample ones deliver to the training device."""
    train_device = "cuda" if cuda else "cpu"
    folder = functools.partial(ImageFolder, data, "train")
    raw = functools.partial(ShardDataset, shards / "raw", "train")
    jpeg = functools.partial(ShardDataset, shards / "jpeg", "train")
    encoded = functools.partial(ShardDataset, shards / "jpeg", "train", decode=False)
    rows = [
        Pipeline("ImageFolder JPEG", "CPU workers: decode + torchvision", folder,
                 per_sample_pipeline, train_device),
        Pipeline("shards, raw", "CPU workers: torchvision", raw, per_sample_pipeline,
                 train_device),
        Pipeline("shards, JPEG", "CPU workers: decode + torchvision", jpeg, per_sample_pipeline,
                 train_device),
        Pipeline("shards, raw", "main process: batched on the CPU (the GPU path's fallback)", raw,
                 batched_pipeline, "cpu"),
    ]  # fmt: skip
    if cuda:
        rows += [
            Pipeline("shards, raw", "GPU: batched", raw, batched_pipeline, "cuda"),
            Pipeline("shards, JPEG", "GPU: nvJPEG decode + batched", encoded, batched_pipeline,
                     "cuda"),
        ]  # fmt: skip
    return rows


def decode_ms_per_image(files, backend, repeats, device="cpu"):
    """Milliseconds per image to decode encoded JPEGs (bytes already in memory) with one image
    decoder, best of ``repeats``: CPU time by the process clock on the CPU; on CUDA, the wall
    time of one nvJPEG batch of them all."""

    def decode_all():
        if device == "cpu":
            for data in files:
                decode.decode_rgb(data, backend)
        else:
            decode.decode_jpegs(files, device=device, backend=backend)

    clock = time.process_time if device == "cpu" else None
    return timing.time_calls(decode_all, device, iters=repeats, clock=clock).min * 1e3 / len(files)


def decoder_lines(source, repeats, cuda):
    """A table of the installed image decoders (pycls.datasets.formats.decode) on the folder's
    JPEGs."""
    files = [read_image_bytes(path) for path, _ in source.samples]
    backends = ["torchvision"] + (["torchcodec"] if decode.torchcodec_decoders() else [])
    devices = ["cpu"] + (["cuda"] if cuda else [])
    load = "unknown" if timing.load_average() is None else f"{timing.load_average():.2f}"
    lines = [
        "",
        f"Decoding only ({len(files)} JPEGs in memory, ms / image, best of {repeats}: CPU time "
        f"on the CPU, wall time on CUDA; load average {load}; the loader "
        f"above decodes with {decode.backend_name()}; torchcodec: "
        f"{'installed' if 'torchcodec' in backends else 'not installed'}):",
        "",
        "| decoder | " + " | ".join(devices) + " |",
        "|---|" + "---|" * len(devices),
    ]
    for backend in backends:
        cells = [f"{decode_ms_per_image(files, backend, repeats, d):.3f}" for d in devices]
        lines.append(f"| {backend} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def measure(row, args, workers):
    """One measurement of a cell: images/s through a freshly built loader."""

    def run():
        device = torch.device(row.device)
        batches, loader = row.build(row.base(), args, workers, device)
        speed = images_per_second(batches, loader, args.epochs, device)
        del batches, loader  # stop the persistent workers before the next measurement
        return speed

    return run


def main(argv=None):
    args = parse_args(argv)
    work = Path(args.work)
    data = Path(args.data) if args.data else work / "imagefolder"
    if not args.data:
        generate_image_folder(data, args.num_images, args.source_size)
    shards = work / f"shards{args.stored_size}"
    source = ImageFolder(data, "train")
    for fmt in ("raw", "jpeg"):
        result = prepare_split(
            source, shards / fmt / "train", dataset="imagefolder", split="train", fmt=fmt,
            size=args.stored_size, quality=args.quality, workers=max(args.workers),
        )  # fmt: skip
        print(result.summary(), flush=True)
    cuda = torch.cuda.is_available()
    sizes = {
        "ImageFolder JPEG": folder_mib(data / "train"),
        "shards, raw": folder_mib(shards / "raw"),
        "shards, JPEG": folder_mib(shards / "jpeg"),
    }
    rows = pipelines(data, shards, cuda)
    if args.formats:
        formats = write_formats(source, work, args)
        rows += format_rows(formats, serve(formats), work / "tar_index")
        for name in ("wds", "parquet"):
            mib = folder_mib(formats / name)
            label = "WebDataset tars" if name == "wds" else "parquet"
            sizes[label] = sizes[f"{label}, HTTP"] = mib
    cells = {(i, w): measure(row, args, w) for i, row in enumerate(rows) for w in args.workers}
    rounds = timing.alternate(cells, args.repeats, describe=lambda v: f"{v:.0f} images/s")
    # The GPU rows decode and augment on the device: their CPU time is not the pipeline's cost
    cpu_rows = [
        i for i, r in enumerate(rows) if not (r.build is batched_pipeline and r.device == "cuda")
    ]
    cpu_rounds = timing.alternate(
        {i: cpu_ms_per_image(rows[i], args) for i in cpu_rows},
        args.repeats,
        describe=lambda v: f"{v:.2f} CPU ms / image",
    )
    lines = [
        f"{len(source)} images ({args.source_size[0]}x{args.source_size[1]} JPEG sources; shards "
        f"at {args.stored_size} px, JPEG quality {args.quality}; the tars and parquet files hold "
        "the JPEG shards' bytes), ImageNet training preset (random resized crop + flip) to "
        f"{args.image_size} px, batch {args.batch_size}, images/s over {args.epochs} epochs "
        f"after a warm-up epoch, page cache warm. {args.repeats} rounds, every cell once per "
        f"round, the order rotating; load average {rounds.load_range()}; revision "
        f"{timing.source_revision()}.",
        "",
        "CPU ms / image: the whole pipeline in one process on one thread, no worker processes, "
        f"CPU time by the process clock (best of {args.repeats} alternating rounds; load average "
        f"{cpu_rounds.load_range()}). Images/s: the loader with N worker processes, to the "
        "training device, "
        "median of the rounds (best in brackets). Order: the epoch order (DATA_LOADER.ORDER).",
        "",
        "| data | decode / augment | order | MiB on disk | CPU ms / image | " + " | ".join(
            f"{w} worker{'s' if w > 1 else ''}" for w in args.workers) + " |",
        "|---|---|---|---|---|" + "---|" * len(args.workers),
    ]  # fmt: skip
    for i, row in enumerate(rows):
        speeds = [rounds.results[(i, w)] for w in args.workers]
        cells_text = " | ".join(f"{statistics.median(v):.0f} ({max(v):.0f})" for v in speeds)
        cpu_ms = f"{min(cpu_rounds.results[i]):.2f}" if i in cpu_rows else "-"
        order = "shards" if row.build is shard_order_pipeline else "global"
        line = (f"| {row.data} | {row.where} | {order} | {sizes[row.data]:.1f} | {cpu_ms} | "
                f"{cells_text} |")  # fmt: skip
        lines.append(line)
        print(lines[-1], flush=True)
    lines += decoder_lines(source, args.repeats, cuda)
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    Path(args.out).write_text(table)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
