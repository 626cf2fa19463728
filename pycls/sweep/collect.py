"""Sweep collect: every run's results in one file, ROOT_DIR/NAME/sweep.json.

sweep.json is a JSON list with one object per run (strict JSON: non-finite numbers become null):

- ``name``, ``status`` (done / failed / incomplete / not_started / unreadable, see
  pycls/sweep/runs.py), ``error`` (last line of the traceback of a failed run, why an unreadable
  run's config cannot be read, else null), ``problems`` (the log lines left out, else null)
- ``cfg_file``, ``out_dir``, ``log_file``, ``stderr`` (submitit's, null if never launched)
- ``swept``: {swept key: value}; ``cfg``: the whole resolved config as a nested dict
- ``complexity``: the run's ``complexity`` json_stats (flops, params, acts per image), or null
- ``train_epoch``, ``test_epoch``: the json_stats of each epoch (one per epoch; after a requeue
  the re-run epoch's line wins)
- ``epochs_done``, ``final_top1_err`` (test top-1 error after the last epoch; null unless done),
  ``best_top1_err`` (lowest test top-1 error so far), ``train_time`` (seconds in training and
  evaluation epochs, summed)

What cannot be read in a run's files is left out and printed in one line naming the file; the
other runs are collected as usual.
"""

import json
import math
import sys

from pycls.atomic_files import write_text_atomic
from pycls.config import get
from pycls.sweep import cli
from pycls.sweep.runs import (
    describe_problems,
    epochs_of,
    list_runs,
    load_job_records,
    run_status,
)
from pycls.sweep.samplers import build_samplers
from pycls.sweep.sweep_file import sweep_json_path


def _plain(obj):
    """JSON-ready copy: dicts and lists of plain values, non-finite floats as None."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def collect_run(run, swept_keys, record=None):
    """The sweep.json entry of one run."""
    problems = []
    stats = run.load_stats(problems)
    train, test = epochs_of(stats, "train_epoch"), epochs_of(stats, "test_epoch")
    complexity = [s for s in stats if s.get("_type") == "complexity"]
    status = run_status(run, stats)
    errors = [s["top1_err"] for s in test if _finite(s.get("top1_err"))]
    final = test[-1].get("top1_err") if status == "done" and test else None
    return {
        "name": run.name,
        "status": status,
        "error": run.error_message() if status == "failed" else None,
        "problems": describe_problems(run.log_file, problems) if problems else None,
        "cfg_file": run.cfg_file,
        "out_dir": run.out_dir,
        "log_file": run.log_file,
        "stderr": (record or {}).get("stderr"),
        "swept": {key: get(run.cfg, key) for key in swept_keys},
        "cfg": run.cfg,
        "complexity": complexity[-1] if complexity else None,
        "epochs_done": int(train[-1]["epoch_num"]) if train else 0,
        "final_top1_err": final if _finite(final) else None,
        "best_top1_err": min(errors) if errors else None,
        "train_time": sum(s["time_epoch"] for s in train + test if _finite(s.get("time_epoch"))),
        "train_epoch": train,
        "test_epoch": test,
    }


def unreadable_run(name, cfg_file, out_dir, why):
    """The sweep.json entry of a run whose config cannot be read."""
    return {
        "name": name,
        "status": "unreadable",
        "error": why,
        "problems": None,
        "cfg_file": cfg_file,
        "out_dir": out_dir,
        "log_file": None,
        "stderr": None,
        "swept": {},
        "cfg": None,
        "complexity": None,
        "epochs_done": 0,
        "final_top1_err": None,
        "best_top1_err": None,
        "train_time": 0.0,
        "train_epoch": [],
        "test_epoch": [],
    }


def collect_sweep(sc, problems=None):
    """Writes sweep.json; returns its list of runs. ``problems`` (a list) gets one line per file
    that could not be read in full (the runs' entries say the same)."""
    problems = [] if problems is None else problems
    swept_keys = [s.key for s in build_samplers(sc)]
    records = load_job_records(sc, problems)
    unreadable = {}
    entries = {
        r.name: collect_run(r, swept_keys, records.get(r.name)) for r in list_runs(sc, unreadable)
    }
    for name, (cfg_file, out_dir, why) in unreadable.items():
        entries[name] = unreadable_run(name, cfg_file, out_dir, why)
        problems.append(f"{cfg_file}: run {name} left out: {why}")
    problems += [e["problems"] for e in entries.values() if e["problems"]]
    runs = _plain([entries[name] for name in sorted(entries)])
    write_text_atomic(sweep_json_path(sc), json.dumps(runs, indent=1, allow_nan=False))
    return runs


def _run(sc, args):
    problems = []
    runs = collect_sweep(sc, problems)
    for line in problems:
        print(f"sweep: {line}", file=sys.stderr)
    counts = {}
    for r in runs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"sweep {sc.NAME}: {len(runs)} runs ({summary}) -> {sweep_json_path(sc)}")
    for r in runs:
        if r["status"] == "failed":
            print(f"FAILED {r['name']}: {r['error']}\n         log: {r['log_file']}")
            if r["stderr"]:
                print(f"         stderr: {r['stderr']}")
    return 0


def main(argv=None, prog=None):
    return cli.run_tool(
        "Gather the results of a sweep's runs into sweep.json.", _run, argv, prog=prog
    )
