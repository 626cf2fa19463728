"""The run_net.py command line, as far as it can be answered without torch: the modes, the
arguments, the config read and checked (``pycls.config.read_cfg``: pure), what its data paths
hold (``pycls.config.data_source``) and, for training, whether a live run holds OUT_DIR. A
mistyped mode or key, a bad value, a missing file or data path, an OUT_DIR in use: one line and
exit status 2 in about a second, before the training code loads (``pycls.core.cli`` runs what
passes).
"""

import argparse
import os
import sys
from dataclasses import dataclass

from pycls.checkpoint import run_lock
from pycls.config.data_source import DataSource, find_data_source, require_readable
from pycls.config.loading import read_cfg
from pycls.distributed.environments import launcher_env
from pycls.errors import REPORTED, reported

# Each mode and what it does, in the order --help lists them
MODES = {
    "train": "train, evaluate every TRAIN.EVAL_PERIOD epochs, checkpoint, resume automatically",
    "test": "evaluate the checkpoint TEST.WEIGHTS on the test split",
    "time": "time forward, backward, optimizer step and data loading: images/s, TFLOP/s, memory",
    "info": "dry run: print the resolved config and the model's size (params, FLOPs), then exit",
    "lrfind": "learning-rate range test: a table, a plot and a suggested OPTIM.BASE_LR in OUT_DIR",
    "scale": "scale a CNN config by MODEL.SCALING_TYPE / SCALING_FACTOR: the scaled config in "
    "OUT_DIR/CFG_DEST, its size before and after",
}

# The modes that read the data (time measures the model on synthetic batches, and the loader
# only where the data is there)
READ_DATA = ("train", "test", "lrfind")


@dataclass(frozen=True)
class Request:
    """What the command line asks: a mode, the config as written (read and checked) and what
    its DATA.PATH holds on this machine (``pycls.config.data_source``: the machine step's first
    answer, which ``resolve_for_machine`` takes)."""

    mode: str
    cfg: object  # a frozen CfgNode
    source: DataSource | None = None


def parse_args(argv=None):
    # "python -m pycls" would otherwise show as "__main__.py"
    prog = "python -m pycls" if os.path.basename(sys.argv[0]) == "__main__.py" else None
    modes = "\n".join(f"  {name:<8} {what}" for name, what in MODES.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train, test, time or inspect a pycls model from a YAML config.\n\nmodes:\n"
        + modes,
        epilog="Any KEY VALUE pair after the options overrides the config, e.g. OUT_DIR /tmp/run.\n"
        "Every key, its default and what it means: pycls/config/sections/ (docs/configs.md: "
        "Config reference).\n\nThe other commands, each with its --help: pycls export, "
        "consolidate, prepare,\nsweep-setup, sweep-launch, sweep-collect, sweep-analyze (tools/ in "
        "a checkout).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", required=True, choices=list(MODES), help="what to run (above)")
    parser.add_argument(
        "--cfg",
        dest="cfg_file",
        required=True,
        help="config file (YAML), or the name of a bundled one (quickstart, vit_b16, ...)",
    )
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    return parser.parse_args(argv)


def read_request(argv=None):
    """The Request of ``argv``; ConfigError (or SystemExit, for argparse's mistakes and --help)
    for what is wrong with it. What the machine answers in a second is asked here too, before
    torch loads: a data path that is not there, an OUT_DIR that a live run holds (training)."""
    args = parse_args(argv)
    cfg = read_cfg(args.cfg_file, args.opts)
    source = find_data_source(cfg)
    if args.mode in READ_DATA:
        require_readable(cfg, source)
    if args.mode == "train" and is_first_process():  # the others wait for it to take the lock
        run_lock.refuse_if_held(cfg.OUT_DIR)
    return Request(args.mode, cfg, source)


def is_first_process():
    env = launcher_env()
    return env is None or env.rank == 0


def read_request_or_exit(argv=None):
    """The Request of ``argv``; a mistake ends the process with its one line (printed by the
    first process of a launcher's: every process reads the same config) and its exit status."""
    try:
        return read_request(argv)
    except REPORTED as e:
        status, line = reported(e)
        if is_first_process():
            print(line, file=sys.stderr, flush=True)
        sys.exit(status)
