#!/usr/bin/env python3
"""Converts a pycls checkpoint's weights for use elsewhere: safetensors, timm or torchvision.

    python tools/export_weights.py CHECKPOINT --format safetensors|timm|torchvision [--out FILE]

CHECKPOINT is a pycls checkpoint (model_epoch_XXXX.pyth, model_best.pyth, a sharded folder) or a
model_final.safetensors; the model is rebuilt from the config stored inside it.

- safetensors: pycls naming, the config as metadata (loads back with TRAIN.WEIGHTS).
- timm: timm naming as .safetensors; its metadata builds the same network with timm alone,
  timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"]))
  (docs/finetuning.md: Exporting).
- torchvision: a torch file of the state dict in torchvision naming, for
  torchvision.models.VisionTransformer (class-token models only).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.checkpoint.single_file import CheckpointError  # noqa: E402
from pycls.core.weights import EXPORT_FORMATS, WeightsError, export_checkpoint  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a pycls checkpoint file or folder, or .safetensors")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    parser.add_argument("--out", default=None, help="output file (default: next to CHECKPOINT)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.checkpoint):
        parser.error(f"{args.checkpoint} does not exist")
    try:
        print(export_checkpoint(args.checkpoint, args.format, args.out))
    except (WeightsError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
