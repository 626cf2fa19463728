"""Plots and progress output: the LR range test's axes, the sweep analysis' plots, the order of
the sweep launch's messages."""

import json
import os
import types

import pytest
import yaml

from pycls.core.lr_finder import _write, plot_y_limits
from pycls.sweep import analyze, setup
from pycls.sweep import submit as launch
from pycls.sweep.sweep_file import load_sweep_cfg, sweep_json_path


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
