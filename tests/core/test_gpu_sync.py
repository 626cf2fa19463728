"""No host-device synchronisation inside a training step.

The trainer's own loop (``Trainer.train_epoch``: LR schedule, mixup, autocast forward, backward,
gradient clipping, optimizer step, EMA, meters) runs at least 20 steps on batches already on the
GPU under ``torch.cuda.set_sync_debug_mode("error")``, so any call that waits for the device
raises. Only ``Meter.sync`` and ``Meter.epoch_stats`` may synchronise: they are the points where
the trainer reads its numbers by design (every ``LOG_PERIOD`` steps and at the end of an epoch).

bfloat16 only: float16's loss scaler reads one overflow flag per step (``DynamicLossScaler.step``),
the one sync the docs allow (docs/recipes.md). The data loader's copies are not part of the step
and are not checked here.
"""

import contextlib

import pytest
import torch

from pycls import config
from pycls.core import meters
from tests.helpers import QUICKSTART

SMALL = [
    "VIT.DEPTH", "2", "VIT.WIDTH", "64", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "128",
    "TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic",
    "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8",
    "OPTIM.CLIP_GRAD", "1.0", "OPTIM.WARMUP_EPOCHS", "1", "LOG_PERIOD", "5",
]  # fmt: skip
# The recipes' paths: O1 with the ImageNet extras (mixup/cutmix, EMA, contiguous AdamW); O2's
# master weights; O3 with per-tensor AdamW in the class-token, batch-first layout
CASES = {
    "O1_recipe": ["AMP.LEVEL", "O1", "OPTIM.CONTIGUOUS_PARAMS", "True", "TRAIN.EMA", "True",
                  "MIXUP.ALPHA", "0.8", "MIXUP.CUTMIX_ALPHA", "1.0"],
    "O2_master": ["AMP.LEVEL", "O2", "OPTIM.CONTIGUOUS_PARAMS", "True"],
    "O3_per_tensor": ["AMP.LEVEL", "O3", "VIT.CLASSIFIER", "token", "VIT.LAYOUT", "batch_first"],
}  # fmt: skip
MIN_STEPS = 20


def _device_batches(trainer, device):
    """The loader's first batches, moved to the device once (the step, not the copy, is tested)."""
    batches = []
    for images, labels, skipped in trainer.train_batches:
        batches.append((images.to(device), labels.to(device), skipped))
    return batches


class SyncDebugMode:
    """``torch.cuda.set_sync_debug_mode`` as contexts: ``strict()`` raises on any synchronising
    call, ``allowed()`` lifts that for the trainer's reads by design."""

    def strict(self):
        return self._mode("error")

    def allowed(self):
        return self._mode("default")

    @contextlib.contextmanager
    def _mode(self, mode):
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)


def train_without_sync(cfg, device, modes):
    """Runs epochs of the trainer's loop on device-resident batches until MIN_STEPS steps have
    run, under ``modes.strict()`` except inside the meters' sync points (``modes.allowed()``).
    Returns the train_epoch stats."""
    from pycls.core.trainer import Trainer

    trainer = Trainer(cfg, device)
    trainer.train_batches = _device_batches(trainer, device)
    steps_per_epoch = len(trainer.train_batches)
    epochs = -(-MIN_STEPS // steps_per_epoch)

    def read_by_design(method):
        def wrapper(self, *args, **kwargs):
            with modes.allowed():
                return method(self, *args, **kwargs)

        return wrapper

    stats = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(meters.Meter, "sync", read_by_design(meters.Meter.sync))
        mp.setattr(meters.Meter, "epoch_stats", read_by_design(meters.Meter.epoch_stats))
        for epoch in range(epochs):
            with modes.strict():
                stats.append(trainer.train_epoch(epoch))
    batch = cfg.TRAIN.BATCH_SIZE
    assert sum(s["num_samples"] for s in stats) == epochs * steps_per_epoch * batch
    return stats


def _cfg(tmp_path, case, device):
    return config.load_cfg(
        QUICKSTART,
        [*SMALL, *CASES[case], "AMP.DTYPE", "bfloat16", "OUT_DIR", str(tmp_path), "DEVICE", device],
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(CASES))
def test_training_steps_do_not_synchronise(tmp_path, case):
    device = torch.device("cuda")
    stats = train_without_sync(_cfg(tmp_path, case, "cuda"), device, SyncDebugMode())
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in stats)


class _RecordedModes(SyncDebugMode):
    """The modes the harness asks for, recorded instead of set (no CUDA here)."""

    def __init__(self):
        self.log = []

    @contextlib.contextmanager
    def _mode(self, mode):
        self.log.append(mode)
        yield


@pytest.mark.usefixtures("single_thread")
def test_the_no_sync_harness_runs_on_the_cpu(tmp_path):
    """The harness itself (device batches, patched meters, epochs until 20 steps) on the CPU, so
    that the GPU test can only fail on a synchronisation: strict mode for each epoch, lifted for
    each LOG_PERIOD read and each epoch's totals."""
    modes = _RecordedModes()
    stats = train_without_sync(_cfg(tmp_path, "O1_recipe", "cpu"), torch.device("cpu"), modes)
    steps_per_epoch = 8  # the synthetic set holds 8 batches
    assert len(stats) == 3 and len(stats) * steps_per_epoch >= MIN_STEPS
    # per epoch: strict, a read at steps 5 and 8 (LOG_PERIOD 5, the last step), the epoch-end
    # sync and the totals
    assert modes.log == ["error", "default", "default", "default", "default"] * 3
    assert all(s["skipped_steps"] == 0 for s in stats)
