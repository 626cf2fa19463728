"""One training step: the trainer's loop, --mode time, the LR finder and the profiler run the same
step, so that every speed figure comes from the step that trains.

A recipe with every part of the step switched on (accumulation, mixup, EMA, clipping, bfloat16
autocast) is run three ways: one training epoch, ``--mode time``, and the LR range test; the
operations each runs per optimizer step are counted and must be the same, and torch's profiler
must see the same operators in a trained step and a timed one.
"""

import collections

import pytest
import torch

from pycls import config
from pycls.core import benchmark, lr_finder, meters, trainer, training_step
from pycls.core.ema import ModelEMA
from pycls.datasets.loading.transforms import BatchMixer
from pycls.engines.base import Engine
from pycls.engines.precision import Precision
from tests.helpers import QUICKSTART

ACCUM = 2
RECIPE = [
    "VIT.DEPTH", "1", "VIT.WIDTH", "32", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64",
    "TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic",
    "TRAIN.BATCH_SIZE", "16", "TEST.BATCH_SIZE", "16", "TRAIN.ACCUM_STEPS", str(ACCUM),
    "MIXUP.ALPHA", "0.8", "TRAIN.EMA", "True", "OPTIM.CLIP_GRAD", "1.0",
    "AMP.LEVEL", "O1", "AMP.DTYPE", "bfloat16", "AMP.CPU_LEVEL", "same", "DEVICE", "cpu",
    "LOG_PERIOD", "100", "PREC_TIME.WARMUP_ITER", "1", "PREC_TIME.NUM_ITER", "2",
    "LRFIND.NUM_ITERS", "3", "DATA_LOADER.NUM_WORKERS", "0",
]  # fmt: skip

# What one optimizer step does, each counted where it happens
COUNTED = {
    "set_lr": (training_step, "set_lr"),
    "mixup": (BatchMixer, "__call__"),
    "forward_backward": (Engine, "forward_backward"),
    "engine_step": (Engine, "step"),
    "ema_update": (ModelEMA, "update"),
    "autocast": (Precision, "autocast"),
}


@pytest.fixture
def counts(monkeypatch):
    seen = collections.Counter()
    for name, (owner, attr) in COUNTED.items():
        original = getattr(owner, attr)

        def counted(*args, _original=original, _name=name, **kwargs):
            seen[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, attr, counted)
    return seen


def _cfg(tmp_path, *overrides):
    return config.load_cfg(QUICKSTART, [*RECIPE, "OUT_DIR", str(tmp_path), *overrides])


def _per_step(seen, steps):
    return {name: seen[name] / steps for name in COUNTED}


def test_time_mode_runs_the_trainers_step(tmp_path, counts):
    cfg = _cfg(tmp_path / "train")
    t = trainer.Trainer(cfg, trainer.setup_env(cfg))
    t.train_epoch(0)
    n_steps = len(t.train_loader) // ACCUM
    trained = _per_step(counts, n_steps)
    # one step: the LR set once, ACCUM micro-batches mixed and run under autocast, one engine
    # step (unscale, clip, optimizer), one EMA update
    assert trained == {
        "set_lr": 1,
        "mixup": ACCUM,
        "forward_backward": ACCUM,
        "engine_step": 1,
        "ema_update": 1,
        "autocast": ACCUM,
    }

    counts.clear()
    step, run, _ = benchmark.synthetic_training(_cfg(tmp_path / "time"), torch.device("cpu"))
    for _ in range(3):
        run()
    assert _per_step(counts, 3) == trained

    # --mode time: its "train step" phases are that step, warm-up and timed iterations included
    # (synchronised at each step, then NUM_ITER back to back); its other phases (forward,
    # forward + backward, optimizer step alone) add no LR, mixup, EMA
    counts.clear()
    stats = benchmark.time_model(_cfg(tmp_path / "time_mode"))
    timed_steps = cfg.PREC_TIME.WARMUP_ITER + 2 * cfg.PREC_TIME.NUM_ITER
    for name in ("set_lr", "mixup", "engine_step", "ema_update"):
        assert counts[name] == trained[name] * timed_steps, name
    assert stats["batch_size"] == cfg.TRAIN.BATCH_SIZE  # a step's images: ACCUM micro-batches


def test_the_lr_finder_runs_the_trainers_step(tmp_path, counts):
    result = lr_finder.find_lr(_cfg(tmp_path))
    steps = len(result["lrs"])
    assert steps == 3
    assert counts["set_lr"] == steps and counts["ema_update"] == steps
    assert counts["mixup"] == counts["forward_backward"] == ACCUM * steps


def _op_counts(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(
        {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}
    )


def test_a_timed_step_runs_the_operators_of_a_trained_step(tmp_path):
    """The profiler's operator list of one timed step equals that of one training step (same
    shapes: the synthetic micro-batch is the loader's; mixup alone, whose choice is fixed)."""
    cfg = _cfg(tmp_path / "train")
    t = trainer.Trainer(cfg, trainer.setup_env(cfg))
    t.engine.train()
    t.train_loader.sampler.set_epoch(0)
    loaded, meter = iter(t.train_batches), meters.Meter(torch.device("cpu"))
    t.step(loaded, 1e-3, True, meter)  # warm-up: optimizer state, EMA copy
    # the next step's micro-batches loaded first: the loader is timed apart from the step
    batches = iter([next(loaded) for _ in range(ACCUM)])
    trained = _op_counts(lambda: t.step(batches, 1e-3, True, meter))

    _, run, _ = benchmark.synthetic_training(_cfg(tmp_path / "time"), torch.device("cpu"))
    run()
    timed = _op_counts(run)
    assert trained and timed == trained
