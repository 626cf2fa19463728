#!/usr/bin/env python3
"""Turns a sharded (torch.distributed.checkpoint) checkpoint folder into one pycls file.

    python tools/consolidate_checkpoint.py OUT_DIR/checkpoints/model_epoch_0100 [--out FILE]

The file holds the full model state and loads in one process (TEST.WEIGHTS, TRAIN.WEIGHTS,
pycls.checkpoint.single_file.load_model_weights).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.checkpoint.sharded import consolidate  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a model_epoch_XXXX checkpoint folder")
    parser.add_argument("--out", default=None, help="output file (default: FOLDER.pyth)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.folder):
        parser.error(f"{args.folder} is not a checkpoint folder")
    print(consolidate(args.folder, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
