#!/usr/bin/env python3
"""Data-loader throughput (images/s through to normalised batches on the device) for:

- an image folder of JPEGs, decoded and augmented per sample by torchvision on the CPU workers;
- shards (raw pixels or JPEG), augmented per sample on the CPU workers;
- raw shards, augmented in whole batches by the GPU path's code running on the CPU (its fallback);
- shards (raw or JPEG) augmented, and for JPEG decoded, on the GPU (when CUDA is present);

all with the ImageNet training preset (random resized crop + flip) at --image-size, for each
worker count in --workers; then the image decoders alone (torchvision, and TorchCodec where
installed; on the CPU, and nvJPEG batches on CUDA). Without --data it generates an image folder
of smooth-noise JPEGs.

    python benchmarks/loader_speed.py --workers 1 2 --out /tmp/loader_bench.md

Prints a markdown table and writes it to --out.
"""

import argparse
import functools
import os
import sys
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
    decode,  # noqa: E402
)
from pycls.datasets.gpu_augment import (  # noqa: E402
    DeviceAugment,
    DeviceAugmentBatches,
    DeviceAugmentDataset,
    construct_device_loader,
)
from pycls.datasets.imagefolder import read_image_bytes  # noqa: E402
from pycls.datasets.shards import ShardDataset, prepare_split  # noqa: E402


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


def loader_options(args, workers):
    return dict(
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
    """CPU time per image of one pipeline run entirely in this process on one thread (no worker
    processes): load, decode, augment, collate and normalise. Steadier than images/s on a shared
    machine; the best of --repeats epochs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches, loader = row.build(row.base(), args, 0, torch.device("cpu"))
        run, counted = epoch_runner(batches, loader)
        epoch = timing.time_calls(run, None, warmup=0, iters=args.repeats)
        return epoch.min / counted[0] * 1e3
    finally:
        torch.set_num_threads(threads)


def per_sample_pipeline(base, args, workers, device):
    mean, std = DATASET_STATS["imagefolder"]
    factory = functools.partial(build_transform, "imagenet")
    dataset = AugmentedDataset(base, factory, True)
    loader = construct_loader(dataset, **loader_options(args, workers))
    return DeviceBatches(loader, device, mean, std), loader


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
    decoder, best of ``repeats``; on CUDA, one nvJPEG batch of them all."""

    def decode_all():
        if device == "cpu":
            for data in files:
                decode.decode_rgb(data, backend)
        else:
            decode.decode_jpegs(files, device=device, backend=backend)

    return timing.time_calls(decode_all, device, iters=repeats).min * 1e3 / len(files)


def decoder_lines(source, repeats, cuda):
    """A table of the installed image decoders (pycls.datasets.decode) on the folder's JPEGs."""
    files = [read_image_bytes(path) for path, _ in source.samples]
    backends = ["torchvision"] + (["torchcodec"] if decode.torchcodec_decoders() else [])
    devices = ["cpu"] + (["cuda"] if cuda else [])
    lines = [
        "",
        f"Decoding only ({len(files)} JPEGs in memory, ms / image, best of {repeats}; the loader "
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
    lines = [
        f"{len(source)} images ({args.source_size[0]}x{args.source_size[1]} JPEG sources; shards "
        f"at {args.stored_size} px, JPEG quality {args.quality}), ImageNet training preset "
        f"(random resized crop + flip) to {args.image_size} px, batch {args.batch_size}, "
        f"images/s over {args.epochs} epochs after a warm-up epoch (best of {args.repeats}), page "
        "cache warm.",
        "",
        "CPU ms / image: the whole pipeline in one process on one thread (best of "
        f"{args.repeats}). Images/s: the loader with N worker processes, to the training device.",
        "",
        "| data | decode / augment | MiB on disk | CPU ms / image | " + " | ".join(
            f"{w} worker{'s' if w > 1 else ''}" for w in args.workers) + " |",
        "|---|---|---|---|" + "---|" * len(args.workers),
    ]  # fmt: skip
    for row in pipelines(data, shards, cuda):
        speeds = []
        for workers in args.workers:
            device = torch.device(row.device)
            best = 0.0
            for _ in range(args.repeats):
                batches, loader = row.build(row.base(), args, workers, device)
                best = max(best, images_per_second(batches, loader, args.epochs, device))
                del batches, loader  # stop the persistent workers before the next measurement
            speeds.append(best)
        cells = " | ".join(f"{s:.0f}" for s in speeds)
        on_gpu = row.build is batched_pipeline and row.device == "cuda"
        cpu_ms = "-" if on_gpu else f"{cpu_ms_per_image(row, args):.2f}"
        line = f"| {row.data} | {row.where} | {sizes[row.data]:.1f} | {cpu_ms} | {cells} |"
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
