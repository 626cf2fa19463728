"""Sweep analysis: a markdown table and PNG plots from sweep.json, into ROOT_DIR/NAME/analysis/.

- ``summary.md``: one row per run (swept values, status, final and best test top-1 error,
  parameters, FLOPs, training time) and the best run.
- ``error_vs_<key>.png`` for every swept key (log axis for log-uniform samplers, learning rates,
  weight decay and positive values spanning a decade or more; categories for non-numeric
  values), ``error_vs_flops.png`` (only when the runs differ in FLOPs) and
  ``error_vs_train_time.png``: final (filled) and best (hollow) error of every run with a final
  error.
- ``test_curves.png``: test top-1 error per epoch of every run.

A sweep.json that is not JSON is refused naming it; an entry that is not what collect writes (a
field of the wrong type, an epoch that is not a number) is left out in one line naming the file
and the entry, and the others are analysed.

matplotlib is imported only here, with the Agg backend (no display needed).
"""

import json
import math
import os
import re
import sys

from pycls.sweep import cli
from pycls.sweep.commands import step_command
from pycls.sweep.runs import SweepError
from pycls.sweep.samplers import build_samplers
from pycls.sweep.sweep_file import analysis_dir, sweep_json_path


def load_sweep_json(sc, problems=None):
    """The entries of sweep.json that can be analysed; ``problems`` (a list) gets one line per
    entry left out. SweepError naming the file when it is not a JSON list."""
    path = sweep_json_path(sc)
    if not os.path.isfile(path):
        raise SweepError(f"{path} does not exist; run {step_command('collect')} first")
    try:
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)
    except (OSError, ValueError) as e:
        raise SweepError(
            f"{path} cannot be read ({type(e).__name__}: {e}); run {step_command('collect')} again"
        ) from None
    if not isinstance(runs, list):
        raise SweepError(
            f"{path} holds a JSON {type(runs).__name__}, not a list of runs; run "
            f"{step_command('collect')} again"
        )
    good = []
    for i, run in enumerate(runs):
        why = entry_problem(run)
        if why is None:
            good.append(run)
        elif problems is not None:
            name = run.get("name") if isinstance(run, dict) else None
            problems.append(f"{path}: entry {i} (run {name}) left out: {why}")
    return good


def _is_num(v):
    return isinstance(v, int | float) and not isinstance(v, bool)


# The fields of a sweep.json entry that analyze reads, and what each must be
_ENTRY_FIELDS = {
    "name": (str,),
    "status": (str,),
    "swept": (dict,),
    "final_top1_err": (int, float, type(None)),
    "best_top1_err": (int, float, type(None)),
    "train_time": (int, float, type(None)),
    "complexity": (dict, type(None)),
    "test_epoch": (list,),
}


def entry_problem(run):
    """Why a sweep.json entry cannot be analysed, or None."""
    if not isinstance(run, dict):
        return f"a JSON {type(run).__name__}, not an object"
    for key, kinds in _ENTRY_FIELDS.items():
        value = run.get(key)
        if not isinstance(value, kinds) or isinstance(value, bool):
            return f"{key} is {value!r}"
    for s in run["test_epoch"]:
        if not isinstance(s, dict) or not _is_num(s.get("epoch_num")):
            return f"a test_epoch entry {s!r} without a numeric epoch_num"
        if s.get("top1_err") is not None and not _is_num(s["top1_err"]):
            return f"a test_epoch entry with top1_err {s['top1_err']!r}"
    cx = run["complexity"] or {}
    bad = [k for k in ("flops", "params") if cx.get(k) is not None and not _is_num(cx[k])]
    return f"complexity {bad[0]} is {cx[bad[0]]!r}" if bad else None


# ------------------------------------------------------------------------------------------------ #
# Formatting
# ------------------------------------------------------------------------------------------------ #


def _si(x):
    """1234567 -> '1.23M'."""
    if x is None:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _duration(s):
    if not s:
        return "-"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h"


def _value(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _err(v):
    return "-" if v is None else f"{v:.2f}"


def _cx(run, key):
    return (run.get("complexity") or {}).get(key)


def markdown_table(runs, keys):
    """The summary table: one row per run."""
    head = ["run", *keys, "status", "final top-1 err", "best top-1 err", "params", "FLOPs"]
    head.append("train time")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        row = [r["name"], *(_value(r["swept"].get(k)) for k in keys), r["status"]]
        row += [_err(r["final_top1_err"]), _err(r["best_top1_err"])]
        row += [_si(_cx(r, "params")), _si(_cx(r, "flops")), _duration(r["train_time"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_summary(sc, runs, keys, path):
    done = [r for r in runs if r["final_top1_err"] is not None]
    text = [f"# Sweep {sc.NAME}", ""]
    if sc.DESC:
        text += [sc.DESC, ""]
    counts = {s: sum(r["status"] == s for r in runs) for s in sorted({r["status"] for r in runs})}
    text += [f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", ""]
    if done:
        best = min(done, key=lambda r: r["final_top1_err"])
        values = ", ".join(f"{k}={_value(best['swept'].get(k))}" for k in keys)
        err = best["final_top1_err"]
        text += [f"Best final top-1 error: **{err:.2f}** (run {best['name']}: {values}).", ""]
    text += [markdown_table(runs, keys), ""]
    failed = [r for r in runs if r["status"] == "failed"]
    for r in failed:
        text.append(f"- run {r['name']} failed: `{r['error']}` (log: `{r['log_file']}`)")
    with open(path, "w") as f:
        f.write("\n".join(text) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ #
# Plots
# ------------------------------------------------------------------------------------------------ #


def _plt():
    import matplotlib  # slow to import, needed only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    return plt


# Keys whose values are compared by ratio (a learning rate of 1e-3 vs 4e-3, not 0.001 vs 0.004)
_RATIO_KEY = re.compile(r"(^|\.)([A-Z_]*_LR|WEIGHT_DECAY[A-Z_]*|EPS)$")


def log_axis(xs, key="", dist=""):
    """Whether to plot xs on a log axis: positive numbers drawn log-uniformly, of a key compared
    by ratio (learning rates, weight decay), or spanning a factor of 10 or more."""
    if not xs or not all(_is_num(x) and x > 0 for x in xs):
        return False
    return dist == "log_uniform" or bool(_RATIO_KEY.search(key)) or max(xs) / min(xs) >= 10


def plot_error_vs(runs, xs, xlabel, path, log_x=False):
    """Scatter of final (filled) and best (hollow) top-1 error against xs, one x per run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    numeric = all(_is_num(x) for x in xs)
    if not numeric:  # categories, in the order they first appear
        cats = list(dict.fromkeys(map(str, xs)))
        ax.set_xticks(range(len(cats)), cats, rotation=30 if len(cats) > 4 else 0)
        xs = [cats.index(str(x)) for x in xs]
    final = [r["final_top1_err"] for r in runs]
    best = [math.nan if r["best_top1_err"] is None else r["best_top1_err"] for r in runs]
    ax.scatter(xs, final, label="final", zorder=3)
    ax.scatter(xs, best, facecolors="none", edgecolors="C1", label="best", zorder=3)
    if len(runs) <= 32:  # name the points so a plot leads back to its run
        for x, y, r in zip(xs, final, runs):
            ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if numeric and log_x:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="test top-1 error (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_test_curves(runs, path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for r in runs:
        test = [s for s in r["test_epoch"] if s.get("top1_err") is not None]
        epochs, errors = [s["epoch_num"] for s in test], [s["top1_err"] for s in test]
        ax.plot(epochs, errors, "o-", label=r["name"])
    ax.set(xlabel="epoch", ylabel="test top-1 error (%)", title="test error per run")
    ax.grid(alpha=0.3)
    if len(runs) <= 12:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _file_key(key):
    return re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")


def analyze_sweep(sc, problems=None):
    """Writes summary.md and the plots; returns the paths written. ``problems`` (a list) gets one
    line per entry of sweep.json left out."""
    runs = load_sweep_json(sc, problems)
    samplers = build_samplers(sc)
    keys = [s.key for s in samplers]
    out = analysis_dir(sc)
    os.makedirs(out, exist_ok=True)
    written = [write_summary(sc, runs, keys, os.path.join(out, "summary.md"))]
    done = [r for r in runs if r["final_top1_err"] is not None]
    if not done:
        print("no run has a final error yet: wrote the table only")
        return written
    for s in samplers:
        swept = [r for r in done if r["swept"].get(s.key) is not None]
        xs = [r["swept"][s.key] for r in swept]
        log_x = log_axis(xs, s.key, getattr(s, "dist", ""))
        path = os.path.join(out, f"error_vs_{_file_key(s.key)}.png")
        written.append(plot_error_vs(swept, xs, s.key, path, log_x))
    with_cx = [r for r in done if _cx(r, "flops")]
    xs = [_cx(r, "flops") for r in with_cx]
    if len(set(xs)) > 1:  # every run the same size: error against one x says nothing
        path = os.path.join(out, "error_vs_flops.png")
        label = "FLOPs per image (multiply-adds)"
        written.append(plot_error_vs(with_cx, xs, label, path, log_axis(xs)))
    path = os.path.join(out, "error_vs_train_time.png")
    timed = [r for r in done if r["train_time"] is not None]
    xs = [r["train_time"] for r in timed]
    written.append(plot_error_vs(timed, xs, "training + evaluation time (s)", path, log_axis(xs)))
    written.append(plot_test_curves(done, os.path.join(out, "test_curves.png")))
    return written


def _run(sc, args):
    problems = []
    written = analyze_sweep(sc, problems)
    for line in problems:
        print(f"sweep: {line}", file=sys.stderr)
    for path in written:
        print(f"wrote {path}")
    return 0


def main(argv=None, prog=None):
    return cli.run_tool(
        "Tabulate and plot the results of a collected sweep.", _run, argv, prog=prog
    )
