"""Training that waits for its data says so: every train_iter json_stats line carries the share
of the window's wall time the step waited for the next batch (host time in the loader, no device
sync), and the log says once per run when an epoch's share passed 10 %, with advice that fits the
config and the machine (pycls/core/run_advice.py)."""

import logging

import pytest

from pycls import config
from pycls.core import meters, run_advice, trainer
from tests.helpers import QUICKSTART, json_stats_of, tiny_quickstart


class _Clock:
    """A clock the test moves: ``meters`` reads it instead of the wall clock."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_share_is_the_time_in_next_over_the_windows_time(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(meters.time, "perf_counter", clock)
    meter = meters.Meter("cpu")

    def batches():  # each batch takes 0.3 s to come
        for _ in range(4):
            clock.now += 0.3
            yield None

    timed = meter.timed(batches())
    for _ in range(2):
        next(timed)
        clock.now += 0.7  # the step
    assert meter.sync()["data_wait_share"] == pytest.approx(0.6 / 2.0)
    next(timed)
    clock.now += 0.7
    next(timed)
    assert meter.sync()["data_wait_share"] == pytest.approx(0.6 / 1.3)  # it waits last
    assert meter.epoch_stats()["data_wait_share"] == pytest.approx(1.2 / 3.3)
    assert "data_wait_share" not in meters.Meter("cpu").sync()  # an evaluation: not timed


def test_a_loader_bound_run_logs_the_share_and_says_so_once_per_epoch(tmp_path):
    """64 px digits augmented with RandAugment in the training process itself (no workers),
    fed to a one-block ViT of 16 tokens: the loader is most of every step."""
    cfg = tiny_quickstart(tmp_path, "TRAIN.IM_SIZE", "64", "TEST.IM_SIZE", "16",
                          "VIT.PATCH_SIZE", "16", "TRAIN.AUGMENT", "deit",
                          "DATA.CLASSES", "[0, 1]", "MODEL.NUM_CLASSES", "2",
                          "TRAIN.BATCH_SIZE", "32", "LOG_PERIOD", "2", "OPTIM.MAX_EPOCH", "2",
                          "TRAIN.EVAL_PERIOD", "2", "DATA_LOADER.NUM_WORKERS", "0")  # fmt: skip
    trainer.train_model(cfg)
    iters = json_stats_of(tmp_path, "train_iter")
    assert iters and all(0.0 <= s["data_wait_share"] <= 1.0 for s in iters)
    epochs = json_stats_of(tmp_path, "train_epoch")
    assert len(epochs) == 2 and all(s["data_wait_share"] > 0.1 for s in epochs), epochs
    log = (tmp_path / "stdout.log").read_text().splitlines()
    said = [line.split("]: ", 1)[1] for line in log if "was loader-bound" in line]
    assert len(said) == 1 and said[0].startswith("epoch 1 was loader-bound"), said  # once a run
    assert "(DATA_LOADER.BACKEND torchvision): DATA_LOADER.NUM_WORKERS 0 loads" in said[0]


def test_nothing_is_said_below_the_bound_and_the_rest_once(tmp_path, caplog):
    """Broke when the quickstart (0 workers on purpose) heard "was loader-bound ... add
    workers" after each of its 40 epochs: said once a run, at the first epoch above the bound."""
    notice = run_advice.LoaderBoundNotice(tiny_quickstart(tmp_path))
    with caplog.at_level(logging.INFO):
        notice.epoch_done(0.09, 0)
        for epoch in range(1, 40):
            notice.epoch_done(0.11 if epoch == 1 else 0.5, epoch)
    said = [r.getMessage() for r in caplog.records if "loader-bound" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("epoch 2 was loader-bound"), said
    assert "waited for the next batch 11% of the time" in said[0]


def _advice(tmp_path, cores, threads, *overrides, processes=1):
    cfg = config.read_cfg(QUICKSTART, list(overrides))  # as written: the machine is the test's
    return run_advice.loader_advice(cfg, cores, threads, processes)


def test_the_advice_fits_the_config_and_the_machine(tmp_path):
    """Broke when every loader-bound epoch advised "more workers", also to a run whose workers
    were 0 on purpose and whose cores all ran the step: workers are suggested only for idle
    cores, in the number idle; what else would help fits the backend and the device."""
    quickstart = _advice(tmp_path, 1, 1)  # 0 workers, one core running the step
    assert "loading's part of each step" in quickstart and "workers would take turns" in quickstart
    assert "NUM_WORKERS 1" not in quickstart and "prepared shards" in quickstart
    assert "DATA_LOADER.NUM_WORKERS 3 would load beside" in _advice(tmp_path, 4, 1)
    busy = _advice(tmp_path, 8, 4, "DATA_LOADER.NUM_WORKERS", "4")
    assert "use all 8 cores" in busy and "NUM_WORKERS 5" not in busy
    spare = _advice(tmp_path, 16, 1, "DATA_LOADER.NUM_WORKERS", "2", processes=2)
    assert "leaves 10 of this machine's 16 cores unused: DATA_LOADER.NUM_WORKERS 7" in spare
    shards = _advice(tmp_path, 2, 1, "DATA_LOADER.NUM_WORKERS", "1", "DATA_LOADER.BACKEND",
                     "shards", "DATA_LOADER.SHARD_PATH", str(tmp_path))  # fmt: skip
    assert "prepared shards" not in shards and "as fast as this machine makes it" in shards
