"""Command line of tools/run_net.py: --mode MODE --cfg FILE [KEY VALUE ...]."""

import argparse
import sys

from pycls.core import config, early_signals

MODES = ("train", "test", "time", "info", "lrfind")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train, test, time or inspect a pycls model from a YAML config.",
        epilog="Any KEY VALUE pair after the options overrides the config, e.g. OUT_DIR /tmp/run",
    )
    parser.add_argument("--mode", required=True, choices=MODES, help="what to run")
    parser.add_argument("--cfg", dest="cfg_file", required=True, help="config file (YAML)")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    return parser.parse_args(argv)


def run_mode(mode, cfg):
    """Runs one mode in this process with a loaded config; returns its result."""
    if mode == "info":
        from pycls.core.benchmark import print_info

        return print_info(cfg)
    if mode == "time":
        from pycls.core.benchmark import time_model

        return time_model(cfg)
    if mode == "lrfind":
        from pycls.core.lr_finder import find_lr

        return find_lr(cfg)
    from pycls.core import trainer

    return trainer.train_model(cfg) if mode == "train" else trainer.test_model(cfg)


def main(argv=None):
    args = parse_args(argv)
    if args.mode != "train":  # only training turns a stop signal into a checkpoint
        early_signals.release()
    try:
        cfg = config.load_cfg(args.cfg_file, args.opts)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    config.set_global_cfg(cfg)
    from pycls.core.launch import launch

    try:  # settings that only fail together with the parallel engine stop here, before any work
        launch(run_mode, args.mode, cfg)
    except config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except _artefact_errors() as e:  # the message names the file or OUT_DIR and the cause
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _artefact_errors():
    """Errors about files a run reads or writes (checkpoints, data, the OUT_DIR lock): reported
    in one line, without a traceback (pycls.core.integrity and friends)."""
    from pycls.core.checkpoint import CheckpointError
    from pycls.core.integrity import ClassMismatchError, CorruptFileError
    from pycls.core.run_lock import RunLockedError
    from pycls.core.safe_unpickle import UnsafePickleError
    from pycls.datasets.imagefolder import CorruptImageError

    return (
        CheckpointError,
        ClassMismatchError,
        CorruptFileError,
        CorruptImageError,
        RunLockedError,
        UnsafePickleError,
        OSError,  # a file that cannot be read or written: named by the message
    )
