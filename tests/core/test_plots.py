"""Plots and progress output: the LR range test's axes, the sweep analysis' plots, the order of
the sweep launch's messages, the training curves of a damaged log."""

import errno
import json
import os
import types

import pytest
import yaml

from pycls.core import cli
from pycls.core import logging as logs
from pycls.core.lr_finder import _write, plot_y_limits
from pycls.sweep import analyze, setup
from pycls.sweep import submit as launch
from pycls.sweep.sweep_file import load_sweep_cfg, sweep_json_path
from tests.helpers import QUICKSTART, TINY


def test_lrfind_plot_clips_the_divergence():
    # starts at 2.3, descends to 0.5, then diverges to 12
    losses = [2.3 - 0.1 * i for i in range(19)] + [1.0, 3.0, 6.0, 9.0, 12.0]
    low, high = plot_y_limits(losses)
    assert low < min(losses) and 2.3 < high < 2.6  # the descent fills the axis, 12 runs off it
    assert plot_y_limits([1.0]) is None and plot_y_limits([2.0, 2.0]) is None
    assert plot_y_limits([1.0, 2.0, 3.0])[1] > 3.0  # never descends: show it all


def test_lrfind_plot_applies_the_limits(tmp_path):
    lrs, losses = [1e-4, 1e-3, 1e-2, 1e-1], [2.0, 1.0, 0.5, 30.0]
    assert _write(str(tmp_path), lrs, losses, 1e-3) == plot_y_limits(losses)
    assert (tmp_path / "lrfind.png").stat().st_size > 0


def test_log_axis_for_rates_and_log_uniform_keys():
    assert analyze.log_axis([1e-3, 4e-3], "OPTIM.BASE_LR")  # a grid of rates, 4x apart
    assert analyze.log_axis([0.02, 0.05], "OPTIM.WEIGHT_DECAY")
    assert analyze.log_axis([2.0, 3.0], "MIXUP.ALPHA", "log_uniform")
    assert not analyze.log_axis([2.0, 3.0], "MIXUP.ALPHA", "uniform")
    assert not analyze.log_axis([2, 4], "VIT.DEPTH")
    assert not analyze.log_axis([0.0, 1e-3], "OPTIM.BASE_LR")  # no log of 0


def _sweep(tmp_path, max_parallel=2):
    tree = {
        "NAME": "s",
        "ROOT_DIR": str(tmp_path / "sweeps"),
        "SETUP": {
            "BASE_CFG": "configs/quickstart.yaml",
            "SAMPLERS": {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [1.0e-3, 4.0e-3]}},
        },
        "LAUNCH": {"MODE": "local", "MAX_PARALLEL": max_parallel},
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_sweep_cfg(str(path))


def _run(name, lr, err, flops):
    return {
        "name": name,
        "status": "done",
        "error": None,
        "swept": {"OPTIM.BASE_LR": lr},
        "final_top1_err": err,
        "best_top1_err": err,
        "complexity": {"params": 1000, "flops": flops},
        "train_time": 60.0 + err,
        "test_epoch": [{"epoch_num": 1, "top1_err": err}],
    }


@pytest.mark.parametrize("flops", [(5000, 5000), (5000, 9000)])
def test_sweep_analysis_plots(tmp_path, monkeypatch, flops):
    sc = _sweep(tmp_path)
    runs = [_run("0000", 1e-3, 3.0, flops[0]), _run("0001", 4e-3, 2.0, flops[1])]
    os.makedirs(os.path.dirname(sweep_json_path(sc)), exist_ok=True)
    with open(sweep_json_path(sc), "w") as f:
        json.dump(runs, f)
    axes = {}
    plot = analyze.plot_error_vs

    def recording(runs, xs, xlabel, path, log_x=False):
        axes[os.path.basename(path)] = log_x
        return plot(runs, xs, xlabel, path, log_x)

    monkeypatch.setattr(analyze, "plot_error_vs", recording)
    analyze.analyze_sweep(sc)
    assert axes["error_vs_optim_base_lr.png"] is True
    # every run the same size: no error-vs-FLOPs plot
    assert ("error_vs_flops.png" in axes) == (flops[0] != flops[1])


def test_local_launch_reports_each_run_before_starting_the_next(tmp_path, monkeypatch, capsys):
    sc = _sweep(tmp_path, max_parallel=1)
    setup.setup_sweep(sc)

    class Job:
        def __init__(self, n):
            self.job_id = str(n)
            self.paths = types.SimpleNamespace(stdout=tmp_path / "o", stderr=tmp_path / "e")

        def done(self):
            return True

        def exception(self):
            return None

    class Executor:
        submitted = 0

        def submit(self, job):
            Executor.submitted += 1
            return Job(Executor.submitted)

    monkeypatch.setattr(launch, "make_executor", lambda sc: Executor())
    monkeypatch.setattr(launch, "_POLL_S", 0)
    capsys.readouterr()
    launch.launch_sweep(sc)
    lines = [
        line.split()[0] + " " + line.split()[1] for line in capsys.readouterr().out.splitlines()
    ]
    events = [line for line in lines if line.split()[0] in ("started", "FAILED", "done")]
    assert events == ["started 0000", "FAILED 0000:", "started 0001", "FAILED 0001:"]


# What a kill, a full disk or an edit leaves in a log, each beside good lines: (bytes, problem)
_BAD_LOG_LINES = {
    "a torn UTF-8 sequence": (
        b'[x]: json_stats: {"_type": "train_iter", "a": "\xe2\x82',
        "not JSON (a line cut short?)",
    ),
    "a byte that is not UTF-8": (
        b'[x]: json_stats: {"_type": "train_iter", "a": "\xff"}',
        "bytes that are not UTF-8",
    ),
    "not UTF-8 outside json_stats": (b"[x]: loading /data/\xff\xfe.jpg", None),
    "a null epoch": (b'[x]: json_stats: {"_type": "train_epoch", "epoch_num": null}', None),
    "an error that is text": (
        b'[x]: json_stats: {"_type": "train_epoch", "epoch_num": 3, "top1_err": "n/a"}',
        None,
    ),
    "a list": (b"[x]: json_stats: [1, 2]", "a list, not a dict of stats"),
    "a resume without numbers": (
        b'[x]: json_stats: {"_type": "resume", "epoch": null, "iter": "x"}',
        None,
    ),
}


def _log_with(tmp_path, bad):
    good = [
        {"_type": "train_epoch", "epoch_num": e, "top1_err": 50.0 - e, "loss": 2.0 - e / 10}
        for e in (1, 2)
    ]
    good += [{"_type": "test_epoch", "epoch_num": 2, "top1_err": 40.0, "loss": 1.5}]
    lines = [f"[x]: {logs.dump_json_stats(s)}".encode() for s in good]
    log = tmp_path / "stdout.log"
    log.write_bytes(b"\n".join(lines[:1] + [bad] + lines[1:]) + b"\n")
    return str(log), good


@pytest.mark.parametrize("what", list(_BAD_LOG_LINES))
def test_a_damaged_log_is_read_and_plotted_without_its_bad_lines(tmp_path, what):
    """Whatever a kill or a full disk left in stdout.log, the run's final plot (and every
    reader of json_stats) reads the good lines and names the bad ones."""
    bad, problem = _BAD_LOG_LINES[what]
    log, good = _log_with(tmp_path, bad)
    problems = []
    stats = logs.load_json_stats(log, problems=problems)
    assert all(s in stats for s in good)
    assert problems == ([f"line 2: {problem}"] if problem else [])
    png = str(tmp_path / "curves.png")
    assert logs.plot_training_curves(log, png) == png and os.path.getsize(png) > 0


def test_a_plot_that_cannot_be_written_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    import matplotlib.figure

    log, _ = _log_with(tmp_path, b"")

    def full_disk(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    png = tmp_path / "curves.png"
    with pytest.raises(OSError) as e:
        logs.plot_training_curves(log, str(png))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(png)
    assert sorted(os.listdir(tmp_path)) == ["stdout.log"]  # no partial file, no temporary


@pytest.mark.slow
def test_a_torn_log_does_not_stop_the_next_run_of_its_out_dir(tmp_path, capsys):
    """A kill mid-write leaves a torn UTF-8 sequence in stdout.log; the run resumed in the same
    OUT_DIR appends to it and must still finish with its plot."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "stdout.log").write_bytes(b'[x]: json_stats: {"_type": "train_iter", "a": "\xe2\x82')
    args = ["--mode", "train", "--cfg", QUICKSTART, *TINY, "OPTIM.MAX_EPOCH", "1"]
    assert cli.main([*args, "OUT_DIR", str(out)]) == 0, capsys.readouterr().err
    assert (out / "training_curves.png").stat().st_size > 0
