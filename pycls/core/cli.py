"""Command line of tools/run_net.py: --mode MODE --cfg FILE [KEY VALUE ...]."""

import argparse
import os
import sys

from pycls import distributed as dist
from pycls import signals
from pycls.checkpoint.files import CorruptFileError
from pycls.checkpoint.run_lock import RunLockedError
from pycls.checkpoint.single_file import CheckpointError
from pycls.checkpoint.unpickle import UnsafePickleError
from pycls.core import config, trainer
from pycls.core.benchmark import print_info, time_model
from pycls.core.lr_finder import find_lr
from pycls.datasets.checks import ClassMismatchError
from pycls.datasets.imagefolder import CorruptImageError
from pycls.distributed import launch
from pycls.engines.precision import resolve_cpu_level
from pycls.errors import EXIT_DIVERGED, EXIT_USER_ERROR, DivergedError, UserError

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
        return print_info(cfg)
    if mode == "time":
        return time_model(cfg)
    if mode == "lrfind":
        return find_lr(cfg)

    return trainer.train_model(cfg) if mode == "train" else trainer.test_model(cfg)


def _is_first_process():
    env = dist.launcher_env()
    return env is None or env.rank == 0


def check_mode(mode, cfg):
    """What a mode needs beyond a valid config, checked before any process starts."""
    if mode != "test":
        return
    weights = cfg.TEST.WEIGHTS
    if not weights:
        raise config.ConfigError(
            "TEST.WEIGHTS: --mode test needs the checkpoint to evaluate, e.g. "
            "TEST.WEIGHTS OUT_DIR/checkpoints/model_epoch_0040.pyth"
        )
    if not os.path.exists(weights) and not weights.startswith("zoo:"):  # zoo: fetched later
        raise config.ConfigError(f"TEST.WEIGHTS: {weights} does not exist")


def main(argv=None):
    """Runs the command line; user mistakes end in one line on stderr and exit status 2."""
    args = parse_args(argv)
    if args.mode != "train":  # only training turns a stop signal into a checkpoint
        signals.release()
    launched = False
    try:
        cfg = config.load_cfg(args.cfg_file, args.opts)
        check_mode(args.mode, cfg)
        cfg, note = resolve_cpu_level(cfg)
        if note and _is_first_process():
            print(f"note: {note}", flush=True)

        launched = True
        launch.launch(run_mode, args.mode, cfg)
    except UserError as e:  # config errors, checkpoints that do not fit, paths that do not exist
        _report(e.one_line(), launched)
        return EXIT_USER_ERROR
    except _artefact_errors() as e:  # a bad file: the message names it and the cause
        _report(f"error: {e}", launched)
        return 1
    except DivergedError as e:  # the loss is not finite: where, and what to try
        _report(f"error: {e}", launched)
        return EXIT_DIVERGED
    except KeyboardInterrupt:  # a second Ctrl-C (the first one stops with a checkpoint)
        _report("interrupted: stopped at once by Ctrl-C; nothing was written since the newest "
                "checkpoint", launched)  # fmt: skip
        return dist.INTERRUPTED_EXIT_CODE
    return 0


def _report(line, launched):
    """One line on stderr. Under torchrun or srun every process runs this: the config is the same
    in all of them, so its errors are printed by the first process only; an error of a running
    process may be its own (a file only it read) and is printed with its rank."""
    if _is_first_process():
        print(line, file=sys.stderr, flush=True)
    elif launched:
        print(f"[rank {dist.launcher_env().rank}] {line}", file=sys.stderr, flush=True)


def _artefact_errors():
    """Errors about files a run reads or writes (checkpoints, data, the OUT_DIR lock): reported
    in one line, without a traceback (pycls.checkpoint.files and friends)."""
    return (
        CheckpointError,
        ClassMismatchError,
        CorruptFileError,
        CorruptImageError,
        RunLockedError,
        UnsafePickleError,
        OSError,  # a file that cannot be read or written: named by the message
    )
