"""The runs of a set-up sweep as they stand on disk: configs, logs, and whether each is finished.

A run is **finished** when its ``OUT_DIR/stdout.log`` holds a ``test_epoch`` line for epoch
``OPTIM.MAX_EPOCH``: the trainer always evaluates after the last epoch, so that line is the
result the sweep exists for (it survives deleting checkpoints to save space). A run that raised
leaves its traceback in ``OUT_DIR/sweep_error.txt`` (written by the launched job, removed when the
run is launched again).

Status of a run: ``done`` (finished), ``failed`` (sweep_error.txt), ``incomplete`` (a log but not
finished: running, queued again, or killed without a Python error, e.g. out of memory or time) or
``not_started``.
"""

import glob
import json
import os
from dataclasses import dataclass

from pycls import config
from pycls.core import logging as logs
from pycls.sweep.sweep_file import cfgs_dir, launch_dir

ERROR_FILE = "sweep_error.txt"


class SweepError(RuntimeError):
    """The sweep's folder is not in the state a step needs (not set up, not collected, ...)."""


@dataclass
class Run:
    """One point of a sweep: its name (NNNN), config file and loaded config."""

    name: str
    cfg_file: str
    cfg: object

    @property
    def out_dir(self):
        return self.cfg.OUT_DIR

    @property
    def log_file(self):
        return os.path.join(self.cfg.OUT_DIR, logs.LOG_FILE)

    @property
    def error_file(self):
        return os.path.join(self.cfg.OUT_DIR, ERROR_FILE)

    def load_stats(self):
        """Every json_stats dict of the run's log (none if it has not started)."""
        return logs.load_json_stats(self.log_file) if os.path.isfile(self.log_file) else []

    def error_message(self):
        """The last line of the recorded traceback, or None."""
        if not os.path.isfile(self.error_file):
            return None
        with open(self.error_file) as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1] if lines else "failed (empty traceback)"


def list_runs(sc):
    """The sweep's runs in name order; SweepError if setup has not run."""
    paths = sorted(glob.glob(os.path.join(cfgs_dir(sc), "*.yaml")))
    if not paths:
        raise SweepError(
            f"no run configs in {cfgs_dir(sc)}; run tools/sweep_setup.py with this sweep file first"
        )
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return [Run(n, p, config.load_cfg(p, validate=False)) for n, p in zip(names, paths)]


def epochs_of(stats, kind):
    """The ``kind`` (train_epoch / test_epoch) stats, one per epoch; a resumed run logs an epoch
    again after a requeue, and the later line wins."""
    by_epoch = {s["epoch_num"]: s for s in stats if s.get("_type") == kind and "epoch_num" in s}
    return [by_epoch[e] for e in sorted(by_epoch)]


def is_finished(run, stats=None):
    stats = run.load_stats() if stats is None else stats
    last = run.cfg.OPTIM.MAX_EPOCH
    return any(s.get("epoch_num") == last for s in stats if s.get("_type") == "test_epoch")


def run_status(run, stats=None):
    stats = run.load_stats() if stats is None else stats
    if is_finished(run, stats):
        return "done"
    if os.path.isfile(run.error_file):
        return "failed"
    return "incomplete" if os.path.isfile(run.log_file) else "not_started"


# Job records: launch/jobs.json maps each run to its last submitit job (id, mode, stdout and
# stderr paths, submission time), so later steps can point at the logs and see queued jobs


def jobs_file(sc):
    return os.path.join(launch_dir(sc), "jobs.json")


def load_job_records(sc):
    if not os.path.isfile(jobs_file(sc)):
        return {}
    with open(jobs_file(sc)) as f:
        return json.load(f)


def save_job_records(sc, records):
    os.makedirs(launch_dir(sc), exist_ok=True)
    tmp = jobs_file(sc) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1, sort_keys=True)
    os.replace(tmp, jobs_file(sc))
