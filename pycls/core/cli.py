"""Command line of tools/run_net.py: --mode MODE --cfg FILE [KEY VALUE ...].

The command line and the config as written are read without torch (``command_line``); then the
config is resolved for this machine (``pycls.config.resolve_for_machine``: the device, a CPU's AMP
level, what DATA.PATH holds), what the mode needs is checked, and the mode runs in every process.
"""

import errno
import os
import sys
import tempfile
import traceback

from pycls import config, signals
from pycls import distributed as dist
from pycls.core import builders, trainer
from pycls.core import logging as logs
from pycls.core.benchmark import print_info, time_model
from pycls.core.command_line import (
    is_first_process,
    parse_args,  # noqa: F401  (its old home: the name stays)
    read_request,
)
from pycls.core.lr_finder import find_lr
from pycls.core.scale_config import scale_model
from pycls.datasets.loading.dead_workers import dead_worker_report
from pycls.distributed import launch
from pycls.distributed.preflight import check_float8
from pycls.errors import REPORTED, EnvironmentFailure, environment_message, reported

# Modes that only look at the model: one process whatever NUM_PROCS says (as upstream)
_ONE_PROCESS = ("info", "scale")


def run_mode(mode, cfg):
    """Runs one mode in this process with a loaded config; returns its result."""
    if mode == "info":  # the dry run: nothing is written, no data is read
        changed = config.describe_non_default(cfg)
        print(f"config (keys that differ from the defaults):\n{changed}", flush=True)
        return print_info(cfg)
    if mode == "time":
        return time_model(cfg)
    if mode == "lrfind":
        return find_lr(cfg)
    if mode == "scale":
        return scale_model(cfg)

    return trainer.train_model(cfg) if mode == "train" else trainer.test_model(cfg)


def check_out_dir(cfg):
    """OUT_DIR can be created and written (a byte, flushed to disk: a full disk is found too):
    found now, naming the key, rather than as a bare OSError from whichever file the run happens
    to write first. A full disk or quota is the machine's (exit 1), the rest the user's."""
    out_dir = cfg.OUT_DIR
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write_test.") as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise EnvironmentFailure(
                f"cannot write to OUT_DIR {out_dir}: {environment_message(OSError(e.errno, ''))}"
            ) from None
        raise config.ConfigError(
            f"OUT_DIR: cannot write to {out_dir}: {e.strerror or e}; give a folder you can write"
        ) from None


def run_notes(mode, cfg):
    """Settings that are valid but seldom what was meant, one line each, said before the run
    starts: a warmup as long as the run, an evaluation size other than the training size."""
    if mode != "train":
        return []
    notes, o = [], cfg.OPTIM
    if 0 < o.MAX_EPOCH <= o.WARMUP_EPOCHS:
        schedule = builders.build_lr_schedule(cfg)
        peak = max(schedule(o.MAX_EPOCH * i / 200) for i in range(201))
        share = f" ({peak / schedule.base_lr:.0%} of it)" if schedule.base_lr > 0 else ""
        notes.append(
            f"warning: OPTIM.WARMUP_EPOCHS {o.WARMUP_EPOCHS:g} is not shorter than "
            f"OPTIM.MAX_EPOCH {o.MAX_EPOCH}: the whole run warms up and the learning rate never "
            f"reaches OPTIM.BASE_LR; it peaks at {peak:.3g}{share}. Shorten the warmup"
        )
    if cfg.TEST.IM_SIZE != cfg.TRAIN.IM_SIZE:
        notes.append(
            f"note: training at TRAIN.IM_SIZE {cfg.TRAIN.IM_SIZE} px, evaluating at TEST.IM_SIZE "
            f"{cfg.TEST.IM_SIZE} px"
        )
    return notes


def check_mode(mode, cfg):
    """What a mode needs beyond a valid config, checked before any process starts (and before
    OUT_DIR is made, so that a mistake leaves nothing behind)."""
    if mode == "test":
        weights = cfg.TEST.WEIGHTS
        if not weights:
            raise config.ConfigError(
                "TEST.WEIGHTS: --mode test needs the checkpoint to evaluate, e.g. "
                "TEST.WEIGHTS OUT_DIR/checkpoints/model_epoch_0040.pyth"
            )
        if not os.path.exists(weights) and not weights.startswith("zoo:"):  # fetched later
            raise config.ConfigError(f"TEST.WEIGHTS: {weights} does not exist")
    if mode in ("train", "lrfind"):  # before any process starts
        env = dist.launcher_env()
        trainer.check_processes(cfg, env.world_size if env is not None else cfg.NUM_PROCS)
    if mode in ("train", "lrfind", "time"):  # the modes that train, so convert to float8
        check_float8(cfg.AMP.FLOAT8, cfg.DEVICE)
    if mode != "info":  # info prints only
        check_out_dir(cfg)


def main(argv=None, request=None):
    """Runs the command line (``argv``, or the ``request`` already read from it:
    ``command_line.read_request``); user mistakes end in one line on stderr and exit status 2
    (the other statuses: pycls.errors)."""
    launched = False
    try:
        request = request or read_request(argv)
        mode = request.mode
        if mode != "train":  # only training turns a stop signal into a checkpoint
            signals.release()
        notes = []
        # once, before any process starts; DATA.PATH as the command line found it
        cfg = config.resolve_for_machine(request.cfg, notes, request.source)
        check_mode(mode, cfg)
        if is_first_process():
            for line in [f"note: {note}" for note in notes] + run_notes(mode, cfg):
                print(line, flush=True)

        launched = True
        if mode in _ONE_PROCESS:
            run_mode(mode, cfg)
        else:
            launch.launch(run_mode, builders.launch_settings(cfg), mode, cfg)
    except REPORTED as e:  # mistakes (2), the machine's failures (1), divergence (3)
        status, line = reported(e)
        if isinstance(e, launch.ProcessDied):  # the launcher's traceback: for the log file only
            trace = "".join(traceback.format_exception(e.__cause__ or e))
            if logs.append_to_log(cfg.OUT_DIR, f"{line}\n{trace}"):
                line += f" (details: {os.path.join(cfg.OUT_DIR, logs.LOG_FILE)})"
        _report(line, launched)
        return status
    except RuntimeError as e:  # a loader worker reaped while the step ran: torch's words
        died = dead_worker_report(e)
        if died is None:
            raise
        status, line = reported(died)
        _report(line, launched)
        return status
    except KeyboardInterrupt:  # a second Ctrl-C (the first one stops with a checkpoint)
        _report("interrupted: stopped at once by Ctrl-C, nothing written since", launched)
        return dist.INTERRUPTED_EXIT_CODE
    return 0


def console_main(argv=None, request=None):
    """The commands' entry (tools/run_net.py, ``pycls``, ``python -m pycls``): ``main``, then the
    exit, which a process that had a process group takes without the interpreter's teardown
    (``pycls.distributed.exit_process``), its status kept: a preempted run still exits 75.
    Called inside a process that had groups before (a test runner), only the run's own count."""
    joined_before = dist.groups_joined()
    try:
        code = main(argv) if request is None else main(argv, request)
    except SystemExit as e:  # --help, a preemption's or a Ctrl-C's stop after its checkpoint
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    dist.exit_process(code, joined_before)


def _report(line, launched):
    """One line on stderr. Under torchrun or srun every process runs this: the config is the same
    in all of them, so its errors are printed by the first process only; an error of a running
    process may be its own (a file only it read) and is printed with its rank."""
    if is_first_process():
        print(line, file=sys.stderr, flush=True)
    elif launched:
        print(f"[rank {dist.launcher_env().rank}] {line}", file=sys.stderr, flush=True)
