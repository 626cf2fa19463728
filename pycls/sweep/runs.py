"""The runs of a set-up sweep as they stand on disk: configs, logs, and whether each is finished.

A run is **finished** when its ``OUT_DIR/stdout.log`` holds a ``test_epoch`` line for epoch
``OPTIM.MAX_EPOCH``: the trainer always evaluates after the last epoch, so that line is the
result the sweep exists for (it survives deleting checkpoints to save space). A run that raised
leaves its traceback in ``OUT_DIR/sweep_error.txt`` (written by the launched job, removed when the
run is launched again).

Status of a run: ``done`` (finished), ``failed`` (sweep_error.txt), ``incomplete`` (a log but not
finished: running, queued again, or killed without a Python error, e.g. out of memory or time),
``not_started`` or ``unreadable`` (its config file cannot be read).

A run's files are read as they are, whatever a kill, a full disk or an editor left in them: what
cannot be read (a log line that is not JSON or not UTF-8, an epoch that is not a number, a config
that does not parse) is left out and reported in one line naming the file, and the other runs are
read as usual.
"""

import glob
import json
import os
from dataclasses import dataclass

from pycls import config
from pycls.atomic_files import write_text_atomic
from pycls.core import logging as logs
from pycls.errors import UserError
from pycls.sweep.commands import step_command
from pycls.sweep.sweep_file import cfgs_dir, launch_dir, logs_dir

ERROR_FILE = "sweep_error.txt"
# The json_stats of an epoch, and the fields of theirs the sweep reads: numbers (or null)
EPOCH_TYPES = ("train_epoch", "test_epoch")
NUMBER_FIELDS = ("top1_err", "top5_err", "loss", "time_epoch", "flops", "params", "acts")


class SweepError(UserError, RuntimeError):
    """The sweep's folder is not in the state a step needs (not set up, not collected, ...), or
    one of its files cannot be read; the message names the file."""

    prefix = "sweep error"


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

    def load_stats(self, problems=None):
        """Every json_stats dict of the run's log (none if it has not started) that the sweep
        can use (``clean_stats``); ``problems``, a list, gets one "line N: what" per line left out,
        or the reason the log cannot be read at all."""
        if not os.path.isfile(self.log_file):
            return []
        found = []
        try:
            stats = logs.load_json_stats(self.log_file, problems=found)
        except OSError as e:
            found.append(f"cannot read it: {e.strerror or e}")
            stats = []
        stats = clean_stats(stats, found)
        if problems is not None:
            problems += found
        return stats

    def error_message(self):
        """The last line of the recorded traceback, or None."""
        if not os.path.isfile(self.error_file):
            return None
        try:
            with open(self.error_file, encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError as e:
            return f"failed ({self.error_file} cannot be read: {e.strerror or e})"
        return lines[-1] if lines else "failed (empty traceback)"


def _is_number(value):
    return isinstance(value, int | float) and not isinstance(value, bool)


def clean_stats(stats, problems):
    """``stats`` without the lines the sweep cannot use: an epoch line whose ``epoch_num`` is not
    a whole number >= 1, or any line whose numeric fields (``NUMBER_FIELDS``) hold something
    other than a number or null; each is named in ``problems``."""
    kept = []
    for s in stats:
        kind = s.get("_type")
        epoch = s.get("epoch_num")
        if kind in EPOCH_TYPES and not (_is_number(epoch) and epoch >= 1 and epoch == int(epoch)):
            problems.append(f"a {kind} line with epoch_num {epoch!r}")
            continue
        bad = [k for k in NUMBER_FIELDS if s.get(k) is not None and not _is_number(s[k])]
        if bad:
            problems.append(f"a {kind} line with {bad[0]} {s[bad[0]]!r}")
            continue
        kept.append(s)
    return kept


def describe_problems(path, problems):
    """One line for what was left out of a file: its name, how many, the first of them."""
    more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
    return f"{path}: left out {problems[0]}{more}"


def list_runs(sc, unreadable=None):
    """The sweep's runs in name order; SweepError if setup has not run. A config that cannot be
    read is a ConfigError naming it, unless ``unreadable`` (a dict) is given: then it gets
    {name: (config file, the run's OUT_DIR, why)} and the run is left out of the list."""
    paths = sorted(glob.glob(os.path.join(cfgs_dir(sc), "*.yaml")))
    if not paths:
        raise SweepError(
            f"no run configs in {cfgs_dir(sc)}; run {step_command('setup')} with this sweep file "
            "first"
        )
    runs = []
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            runs.append(Run(name, path, config.load_cfg(path, validate=False)))
        except (UserError, OSError, UnicodeDecodeError) as e:
            if unreadable is None:
                raise
            why = e.one_line() if isinstance(e, UserError) else str(e)
            unreadable[name] = (path, os.path.join(logs_dir(sc), name), why)
    return runs


def epochs_of(stats, kind):
    """The ``kind`` (train_epoch / test_epoch) stats, one per epoch (of stats passed through
    ``clean_stats``); a resumed run logs an epoch again after a requeue, and the later line
    wins."""
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


def load_job_records(sc, problems=None):
    """{run name: its job record}. A jobs.json that cannot be read is a SweepError naming it (a
    launcher must not forget queued jobs), unless ``problems`` (a list) is given: then it gets
    one line naming the file, and no records are returned."""
    path = jobs_file(sc)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
        if not isinstance(records, dict) or not all(isinstance(r, dict) for r in records.values()):
            raise ValueError("not a JSON object of job records")
    except (OSError, ValueError) as e:
        why = f"{path} cannot be read ({type(e).__name__}: {e})"
        if problems is None:
            raise SweepError(f"{why}; delete it if no job of this sweep is queued") from None
        problems.append(f"{why}; job ids and stderr paths left out")
        return {}
    return records


def save_job_records(sc, records):
    os.makedirs(launch_dir(sc), exist_ok=True)
    write_text_atomic(jobs_file(sc), json.dumps(records, indent=1, sort_keys=True))
