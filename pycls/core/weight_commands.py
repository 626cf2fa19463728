"""The commands that turn a run's files into weights for use elsewhere: ``pycls export``
(tools/export_weights.py) and ``pycls consolidate`` (tools/consolidate_checkpoint.py).

    pycls export CHECKPOINT --format safetensors|timm|timm_folder|torchvision [--out FILE]
    pycls consolidate OUT_DIR/checkpoints/model_epoch_0100 [--out FILE]

Each prints the file it wrote. Exit status (pycls.errors): 2 for a mistake (a file that is not a
checkpoint, a model the format cannot express), 1 when the machine fails (a full disk), one line
either way.
"""

import argparse
import os
import sys

from pycls.checkpoint.sharded import consolidate
from pycls.checkpoint.weight_files import EXPORT_FORMATS
from pycls.core.exports import export_checkpoint
from pycls.errors import REPORTED, reported

EXPORT_DESCRIPTION = """Convert a pycls checkpoint's weights for use elsewhere: safetensors, timm \
(a file or a folder) or torchvision.

CHECKPOINT is a pycls checkpoint (model_epoch_XXXX.pyth, model_best.pyth, a sharded folder), a run
folder (its newest checkpoint) or a model_final.safetensors; the model is rebuilt from the config
stored inside it.

- safetensors: pycls naming, the config as metadata (loads back with TRAIN.WEIGHTS).
- timm: timm naming as .safetensors; its metadata builds the same network with timm alone,
  timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"])) (README: Exporting).
- timm_folder: a folder as timm stores models itself (config.json and model.safetensors):
  timm.create_model("local-dir:FOLDER", pretrained=True) builds and loads it, nothing else.
- torchvision: a torch file of the state dict in torchvision naming, for
  torchvision.models.VisionTransformer (class-token models only)."""

CONSOLIDATE_DESCRIPTION = """Turn a sharded (torch.distributed.checkpoint) checkpoint folder into \
one pycls file.

The file holds the full model state and loads in one process (TEST.WEIGHTS, TRAIN.WEIGHTS,
pycls.checkpoint.single_file.load_model_weights)."""


def _run(write):
    """Prints the file ``write()`` wrote; returns the exit status, failures in one line."""
    try:
        print(write())
    except REPORTED as e:
        status, line = reported(e)
        print(line, file=sys.stderr)
        return status
    return 0


def export_main(argv=None, prog=None):
    parser = argparse.ArgumentParser(
        prog=prog,
        description=EXPORT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="a pycls checkpoint file or folder, or .safetensors")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    parser.add_argument(
        "--out", default=None, help="output file or folder (default: next to CHECKPOINT)"
    )
    args = parser.parse_args(argv)
    if not os.path.exists(args.checkpoint):
        parser.error(f"{args.checkpoint} does not exist")
    return _run(lambda: export_checkpoint(args.checkpoint, args.format, args.out))


def consolidate_main(argv=None, prog=None):
    parser = argparse.ArgumentParser(
        prog=prog,
        description=CONSOLIDATE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folder", help="a model_epoch_XXXX checkpoint folder")
    parser.add_argument("--out", default=None, help="output file (default: FOLDER.pyth)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.folder):
        parser.error(f"{args.folder} is not a checkpoint folder")
    return _run(lambda: consolidate(args.folder, args.out))
