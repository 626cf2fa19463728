#!/usr/bin/env python3
"""Prepare a data set once as memory-mapped shards, for DATA_LOADER.BACKEND shards.

    python tools/prepare_dataset.py --dataset imagefolder --data /data/imagenet \\
        --out /data/imagenet_shards --workers 16
    python tools/prepare_dataset.py --dataset digits --out /tmp/digits_shards
    python tools/prepare_dataset.py --verify --out /data/imagenet_shards
    python tools/prepare_dataset.py --dataset cifar10 --data /data/cifar --out /data/cifar_pq \
        --format parquet

The same command as ``pycls prepare`` (pycls/datasets/formats/prepare.py, which documents it).
Rerunning the same command resumes an interrupted preparation.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.datasets.formats.prepare import main, parse_args  # noqa: E402, F401

if __name__ == "__main__":
    sys.exit(main())
