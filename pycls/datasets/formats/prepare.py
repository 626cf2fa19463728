"""Preparing a data set once as memory-mapped shards: the command line of ``pycls prepare`` and
``tools/prepare_dataset.py`` (the format: pycls/datasets/formats/prepared_shards.py; the writing:
pycls/datasets/formats/prepared_shard_writer.py).

    # ImageNet (root/train/CLASS/*.JPEG, root/val/CLASS/*.JPEG): shorter side to 256, centre
    # square, re-encoded as JPEG quality 90
    pycls prepare --dataset imagefolder --data /data/imagenet --out /data/imagenet_shards \\
        --workers 16
    # CIFAR-10 (the python pickles), raw pixels at the native 32 px
    pycls prepare --dataset cifar10 --data /data/cifar --out /data/cifar10_shards
    # The bundled digits (no input)
    pycls prepare --dataset digits --out /tmp/digits_shards
    # Check every byte of prepared shards against the checksums written with them
    pycls prepare --verify --out /data/imagenet_shards
    # The conventions other libraries read too (docs/data_formats.md): WebDataset tar shards
    # (OUT/train-000000.tar ..., OUT/_info.json) or Hugging Face parquet (OUT/data/*.parquet)
    pycls prepare --dataset imagefolder --data /data/imagenet --out /data/imagenet_wds \
        --format wds --size 0 --encoding original
    pycls prepare --dataset cifar10 --data /data/cifar --out /data/cifar_pq --format parquet

Rerunning the same command resumes an interrupted preparation (finished shards are kept) or, when
it is complete, does nothing; a kill at any point (SIGKILL included) leaves no process behind and
nothing under a final name that is not complete. Images that cannot be read are skipped and
listed, with the reason, in OUT/SPLIT/bad_images.txt (--format wds / parquet:
OUT/bad_images_SPLIT.txt, the first few also in the log).
"""

import argparse
import os
import sys
from pathlib import Path

from tqdm import tqdm

from pycls.datasets.formats.catalog import build_dataset
from pycls.datasets.formats.image_header import DEFAULT_MAX_PIXELS
from pycls.datasets.formats.parquet_writer import write_parquet
from pycls.datasets.formats.prepared_shard_writer import prepare_split
from pycls.datasets.formats.prepared_shards import FORMATS, INDEX_JSON, verify_split
from pycls.datasets.formats.shard_writing import ENCODINGS
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.errors import EXIT_USER_ERROR, REPORTED, reported

DATASETS = ("imagefolder", "cifar10", "cifar100", "digits")
# Splits prepared by default, and whether the data set's images need resizing (else native size).
_DEFAULT_SPLITS = {"imagefolder": ["train", "val"]}
_RESIZED = ("imagefolder",)
# Formats other libraries read (pycls.datasets.formats.tar_writer, parquet_writer)
CONVENTIONS = ("wds", "parquet")
# Bad images named in the log one by one (all of them are in the list file)
_SHOWN_BAD = 5


def parse_args(argv=None, prog=None):
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert an image folder, the CIFAR pickles or the bundled digits into "
        "memory-mapped shards (for DATA_LOADER.BACKEND shards).",
        epilog="Rerun the same command to resume an interrupted preparation (killed, even with "
        "SIGKILL, at any point). Exit status: 0 done, 1 the machine failed (a full disk) or "
        "--verify found corruption, 2 a mistake in the arguments or the input.",
    )
    parser.add_argument("--dataset", choices=DATASETS, help="what to read")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check every prepared split under --out (or --splits) against its checksums "
        "instead of preparing; exit status 1 when anything is corrupt",
    )
    parser.add_argument("--data", default="", help="input root (DATA.PATH); not for digits")
    parser.add_argument("--out", required=True, help="output folder (DATA_LOADER.SHARD_PATH)")
    parser.add_argument(
        "--splits",
        nargs="+",
        help="splits to prepare (default: train val for imagefolder, train test otherwise)",
    )
    parser.add_argument(
        "--size",
        type=int,
        help="stored square side: shorter side resized to it, then the centre "
        "square; 0 keeps the native size (default: 256 for imagefolder, 0 otherwise)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS + CONVENTIONS,
        help="raw uint8 pixels (exact, 3 S^2 bytes per image) or "
        "JPEG (default: jpeg for imagefolder, raw otherwise); or wds (WebDataset tar shards) or "
        "parquet (Hugging Face datasets' files), which other libraries read too",
    )
    parser.add_argument(
        "--encoding",
        choices=ENCODINGS,
        help="images in wds / parquet: jpeg (at --quality), png (exact pixels) or original "
        "(an image folder's file bytes, at --size 0); default: original for an image folder at "
        "--size 0, jpeg when resized, png otherwise",
    )
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help="refuse (list as bad) an image declaring more pixels than this, before decoding "
        f"it: a decompression bomb (default {DEFAULT_MAX_PIXELS:,}, as "
        "DATA_LOADER.MAX_IMAGE_PIXELS; 0: no limit)",
    )
    parser.add_argument(
        "--shard-size", type=int, help="images per shard (default: ~1 GiB raw, 8192 JPEGs)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="processes writing shards in parallel (default: min(8, CPUs))",
    )
    parser.add_argument(
        "--stop-after", type=int, help="stop after writing this many shards (to test resuming)"
    )
    args = parser.parse_args(argv)
    if args.verify:
        return args
    if args.dataset is None:
        parser.error("--dataset is required (unless --verify)")
    if args.dataset != "digits" and not args.data:
        parser.error(f"--dataset {args.dataset} needs --data (the input root)")
    resized = args.dataset in _RESIZED
    args.splits = args.splits or _DEFAULT_SPLITS.get(args.dataset, ["train", "test"])
    args.size = (256 if resized else 0) if args.size is None else args.size
    args.format = args.format or ("jpeg" if resized else "raw")
    if args.encoding is None:
        original = args.dataset == "imagefolder" and args.size == 0
        args.encoding = "original" if original else ("jpeg" if args.size else "png")
    return args


def write_convention(args, source, split, bar):
    """--format wds / parquet: the split written in that convention into --out."""
    write = write_webdataset if args.format == "wds" else write_parquet
    return write(source, args.out, split=split, shard_size=args.shard_size or 1000,
                 size=args.size, encoding=args.encoding, quality=args.quality,
                 workers=args.workers, on_progress=bar.update)  # fmt: skip


def prepare(args, split):
    source = build_dataset(args.dataset, split=split, root=args.data, max_pixels=args.max_pixels)
    folder = os.path.join(args.out, split)
    # disable=None: a bar on a terminal, nothing in a log file.
    with tqdm(total=len(source), desc=split, unit="img", disable=None, dynamic_ncols=True) as bar:
        if args.format in CONVENTIONS:
            result = write_convention(args, source, split, bar)
            for name, reason in result.bad[:_SHOWN_BAD]:
                print(f"bad image left out: {name}: {reason}", flush=True)
            print(result.summary(), flush=True)
            return result
        result = prepare_split(
            source,
            folder,
            dataset=args.dataset,
            split=split,
            fmt=args.format,
            size=args.size,
            quality=args.quality,
            shard_size=args.shard_size,
            workers=args.workers,
            on_progress=bar.update,
            stop_after=args.stop_after,
        )
    print(result.summary(), flush=True)
    return result


def verify(args):
    """Checks every prepared split under --out; returns the exit status."""
    splits = args.splits or sorted(p.parent.name for p in Path(args.out).glob(f"*/{INDEX_JSON}"))
    if not splits:
        print(f"error: no prepared split under {args.out}", file=sys.stderr)
        return EXIT_USER_ERROR
    failed = False
    for split in splits:
        problems = verify_split(Path(args.out) / split)
        print(f"{Path(args.out) / split}: " + ("ok" if not problems else "CORRUPT"), flush=True)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        failed = failed or bool(problems)
    return 1 if failed else 0


def main(argv=None, prog=None):
    """The command line (``pycls prepare``, tools/prepare_dataset.py); returns the exit status
    (pycls.errors: a mistake in the arguments or the input 2, a failure of the machine 1)."""
    args = parse_args(argv, prog)
    if args.verify:
        return verify(args)
    try:
        for split in args.splits:
            prepare(args, split)
    except FileNotFoundError as err:  # --data names no input
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    except REPORTED as err:  # a corrupt input file (2), a full disk (1)
        status, line = reported(err)
        print(line, file=sys.stderr)
        return status
    except ValueError as err:  # arguments that do not fit the input, another preparation
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0
