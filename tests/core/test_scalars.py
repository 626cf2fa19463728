"""TensorBoard curves: the event file read back holds the numbers of the json_stats lines (which
round to 6 significant digits, hence the relative 1e-5)."""

import subprocess
import sys

import pytest

from pycls.core import curve_writers as scalars
from pycls.core import trainer
from tests.helpers import ROOT, json_stats_of, tiny_quickstart


def test_scalars_of_json_stats_lines():
    line = {"_type": "train_iter", "epoch": "3/40", "iter": "10/22", "loss": 2.5, "lr": 0.1}
    assert scalars.scalars_of({**line, "mem": 12}) == (
        2 * 22 + 10,
        {"train_iter/loss": 2.5, "train_iter/lr": 0.1, "train_iter/mem_mib": 12.0},
    )
    epoch = {"_type": "train_epoch", "epoch_num": 3, "num_samples": 1000, "time_epoch": 4.0}
    assert scalars.scalars_of(epoch) == (3, {"train_epoch/images_per_s": 250.0})
    assert scalars.scalars_of({"_type": "complexity", "flops": 1}) is None


def test_tensorboard_is_not_imported_unless_asked():
    code = "import sys, pycls.core.trainer; print(any('tensorboard' in m for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


def test_tensorboard_event_file_holds_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_quickstart(
        tmp_path, "OPTIM.MAX_EPOCH", "2", "TRAIN.EVAL_PERIOD", "1", "TENSORBOARD", "True"
    )
    trainer.train_model(cfg)
    events = EventAccumulator(str(tmp_path / scalars.TENSORBOARD_DIR))
    events.Reload()

    def curve(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    iters = json_stats_of(tmp_path, "train_iter")
    expected = [scalars.scalars_of(s) for s in iters]
    assert curve("train_iter/loss") == [
        (step, pytest.approx(v["train_iter/loss"], rel=1e-5)) for step, v in expected
    ]
    assert [s for s, _ in curve("train_iter/lr")] == [s for s, _ in expected]
    tests = json_stats_of(tmp_path, "test_epoch")
    assert curve("test_epoch/top1_err") == [
        (s["epoch_num"], pytest.approx(float(s["top1_err"]), rel=1e-5)) for s in tests
    ]
    epochs = json_stats_of(tmp_path, "train_epoch")
    throughput = [float(s["num_samples"]) / float(s["time_epoch"]) for s in epochs]
    assert [v for _, v in curve("train_epoch/images_per_s")] == pytest.approx(throughput, rel=1e-5)
    assert len(curve("train_epoch/mem_mib")) == 2
