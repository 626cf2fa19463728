"""A trained run (2 tiny epochs, a checkpoint after each) broken in various ways, then resumed:
a run stopped mid-epoch resumed with another batch size, seed or process count, a corrupt newest
checkpoint set aside (renamed, never deleted), changed hyperparameters applied and logged, an
incompatible change named, a failed checkpoint write that keeps the earlier ones and the best
weights, dead writers' temporaries removed at start, a refused run that leaves the finished run's
config as it was, and the json_stats timeline that survives the resume."""

import errno
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pycls import distributed as dist
from pycls.checkpoint import resume
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint import weight_files as weights
from pycls.checkpoint.files import CheckpointWriteError
from pycls.checkpoint.resume import IncompatibleCheckpointError
from pycls.core import cli, trainer
from pycls.core import logging as logs
from tests.helpers import (
    QUICKSTART,
    TINY,
    StopRequested,
    json_stats_of,
    tiny_quickstart,
)

pytestmark = pytest.mark.usefixtures("single_thread")


_BASE = ["OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_PERIOD", "1", "TRAIN.EVAL_PERIOD", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    trainer.train_model(tiny_quickstart(out, *_BASE))
    return out


def _copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _trainer(out, *overrides):
    cfg = tiny_quickstart(out, *_BASE, *overrides)
    t = trainer.Trainer(cfg, trainer.setup_env(cfg))
    t.resume_or_init()
    return t


def _stopped_mid_epoch(out, *args):
    """A run stopped (with a checkpoint) after 3 steps of its first epoch."""
    t = trainer.Trainer(tiny_quickstart(out, *args), torch.device("cpu"))
    t.resume_or_init()
    t.preemption = StopRequested()
    with pytest.raises(dist.Preempted):
        t.train_epoch(0)
    return checkpoint.get_last_checkpoint(str(out))


def test_mid_epoch_resume_with_another_batch_trains_the_rest_of_the_epoch_once(tmp_path, caplog):
    """Stopped 3 steps (96 samples) into an epoch with batch 32: resumed with batch 48 it trains
    exactly the epoch's remaining samples, each once, and logs the change; batch 64, which
    cannot continue at sample 96 in whole steps, is refused naming the key."""
    args = ["DEVICE", "cpu", "TRAIN.BATCH_SIZE", "32", "LOG_PERIOD", "3", "OPTIM.MAX_EPOCH", "1"]
    out = tmp_path / "run"
    last = _stopped_mid_epoch(out, *args)
    with pytest.raises(resume.ChangedEpochError, match=r"^TRAIN.BATCH_SIZE: 64 does not divide"):
        trainer.Trainer(tiny_quickstart(out, *args, "TRAIN.BATCH_SIZE", "64"),
                        torch.device("cpu")).resume_or_init()  # fmt: skip
    resumed = trainer.Trainer(tiny_quickstart(out, *args, "TRAIN.BATCH_SIZE", "48"),
                              torch.device("cpu"))  # fmt: skip
    with caplog.at_level(logging.INFO):
        resumed.resume_or_init()
    assert f"resume: TRAIN.BATCH_SIZE changed since {last}: 32 -> 48" in caplog.text
    assert resumed.start_iter == 2
    order = [index for index, _, _ in resumed.train_loader.sampler]  # the epoch's whole order
    loads = []
    dataset = resumed.train_dataset
    get = type(dataset).__getitem__
    type(dataset).__getitem__ = lambda self, key: loads.append(key[0]) or get(self, key)
    try:
        stats = resumed.train_epoch(0)
    finally:
        type(dataset).__getitem__ = get
    n_steps = len(resumed.train_loader)
    assert loads == order[96 : n_steps * 48] and stats["num_samples"] == len(loads) > 0


def test_mid_epoch_resume_with_another_order_is_refused_and_process_changes_logged(
    tmp_path, caplog
):
    args = ["DEVICE", "cpu", "TRAIN.BATCH_SIZE", "32", "LOG_PERIOD", "3", "OPTIM.MAX_EPOCH", "1"]
    out = tmp_path / "run"
    last = _stopped_mid_epoch(out, *args)
    with pytest.raises(resume.ChangedEpochError, match=r"^RNG_SEED: 1 -> 5, but .* drew"):
        trainer.Trainer(tiny_quickstart(out, *args, "RNG_SEED", "5"),
                        torch.device("cpu")).resume_or_init()  # fmt: skip
    # As if two processes had written it (96 samples, 48 each): one process continues at 96
    state = checkpoint.load_file(last)
    state["position"]["world_size"] = 2
    checkpoint.save_file(state, last)
    resumed = trainer.Trainer(tiny_quickstart(out, *args), torch.device("cpu"))
    with caplog.at_level(logging.INFO):
        resumed.resume_or_init()
    assert f"resume: processes changed since {last}: 2 -> 1" in caplog.text
    assert resumed.start_iter == 3
    assert cli.main(["--mode", "train", "--cfg", QUICKSTART, *TINY, *args, "OUT_DIR", str(out),
                     "TRAIN.BATCH_SIZE", "64"]) == 2  # fmt: skip


def test_bad_newest_checkpoint_is_set_aside_and_the_run_resumes(trained, tmp_path):
    out = _copy(trained, tmp_path)
    newest = checkpoint.get_checkpoint_path(str(out), 2)
    data = bytearray(Path(newest).read_bytes())
    data[len(data) // 2] ^= 0x01
    Path(newest).write_bytes(bytes(data))
    trainer.train_model(tiny_quickstart(out, *_BASE))
    # Never deleted: renamed with its (corrupt) bytes; epoch 2 trained again from epoch 1
    assert Path(f"{newest}.corrupt").read_bytes() == bytes(data)
    checkpoint.load_file(newest)  # the new one verifies
    checkpoint.load_file(checkpoint.get_checkpoint_path(str(out), 1))
    log = (out / logs.LOG_FILE).read_text()
    assert f"cannot resume from {newest}" in log and "CRC32" in log
    resumes = json_stats_of(out, "resume")
    assert [(r["epoch"], r["iter"]) for r in resumes] == [(1, 0)]
    # The surviving timeline holds each epoch once; the raw log still has every line
    assert [s["epoch_num"] for s in json_stats_of(out, "train_epoch")] == [1, 2]
    raw = logs.load_json_stats(str(out / logs.LOG_FILE), timeline=False)
    assert [s["epoch_num"] for s in raw if s["_type"] == "train_epoch"] == [1, 2, 2]


def test_resume_applies_changed_hyperparameters_and_logs_them(trained, tmp_path):
    out = _copy(trained, tmp_path)
    t = _trainer(out, "OPTIM.WEIGHT_DECAY", "0.5", "OPTIM.BETAS", "[0.5, 0.6]")
    log = (out / logs.LOG_FILE).read_text()
    decay = [g for g in t.optimizer.param_groups if g["name"] == "decay"][0]
    assert decay["weight_decay"] == 0.5
    assert all(tuple(g["betas"]) == (0.5, 0.6) for g in t.optimizer.param_groups)
    assert t.start_epoch == 2  # resumed, optimizer state kept
    assert all(t.optimizer.state[p] for g in t.optimizer.param_groups for p in g["params"])
    assert "OPTIM.WEIGHT_DECAY changed since" in log and "OPTIM.BETAS changed since" in log
    assert "group 'decay': weight_decay 0.05 -> 0.5" in log


@pytest.mark.parametrize(
    "overrides, key", [(["OPTIM.OPTIMIZER", "sgd"], "OPTIM.OPTIMIZER"), (["VIT.WIDTH", "64"], "")]
)
def test_resume_with_an_incompatible_change_names_checkpoint_keys_and_weights(
    trained, tmp_path, overrides, key
):
    out = _copy(trained, tmp_path)
    newest = checkpoint.get_checkpoint_path(str(out), 2)
    with pytest.raises(IncompatibleCheckpointError) as e:
        _trainer(out, *overrides)
    msg = str(e.value)
    assert newest in msg and (key or "VIT.WIDTH") in msg and f"TRAIN.WEIGHTS {newest}" in msg
    assert os.path.exists(newest)  # not mistaken for a corrupt one


def test_write_error_gives_one_message_and_keeps_earlier_checkpoints(
    trained, tmp_path, monkeypatch
):
    out = _copy(trained, tmp_path)
    t = _trainer(out, "OPTIM.MAX_EPOCH", "3")
    before = {p: Path(p).read_bytes() for p in map(str, (out / "checkpoints").iterdir())}

    def full(obj, f, *args, **kwargs):
        f.write(b"part of a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    third = checkpoint.get_checkpoint_path(str(out), 3)
    with pytest.raises(CheckpointWriteError) as e:
        t.save(3)
    assert str(e.value).startswith(f"cannot write {third}: No space left on device")
    assert {p: Path(p).read_bytes() for p in map(str, (out / "checkpoints").iterdir())} == before


def test_best_weights_wait_for_the_epochs_checkpoint(trained, tmp_path, monkeypatch):
    """model_best.pyth is written after the epoch's checkpoint: when that write fails, it still
    holds an epoch some checkpoint holds."""
    out = _copy(trained, tmp_path)
    best = Path(checkpoint.get_best_checkpoint_path(str(out)))
    before = best.read_bytes()
    t = _trainer(out, "OPTIM.MAX_EPOCH", "3", "TRAIN.EVAL_PERIOD", "1")
    t.best = {"top1_err": float("inf")}  # epoch 3 will be the best so far

    def full(*args, **kwargs):
        raise CheckpointWriteError("cannot write model_epoch_0003.pyth: No space left on device")

    monkeypatch.setattr(t, "save", full)
    with pytest.raises(CheckpointWriteError):
        t.fit()
    assert best.read_bytes() == before
    assert checkpoint.load_file(str(best))["epoch"] <= 2


def test_dead_writers_temporaries_are_removed_and_nothing_else(trained, tmp_path):
    out = _copy(trained, tmp_path)
    ckpts = out / "checkpoints"
    (ckpts / "model_epoch_0002.pyth.tmp.6482").write_bytes(b"half")
    (ckpts / "model_epoch_0003.tmp").mkdir()
    (ckpts / "model_epoch_0003.tmp" / "__0_0.distcp").write_bytes(b"half")
    kept = sorted(p.name for p in ckpts.iterdir() if ".tmp" not in p.name)
    trainer.train_model(tiny_quickstart(out, *_BASE))  # nothing to train: evaluates only
    assert sorted(p.name for p in ckpts.iterdir()) == kept


def test_dead_writers_temporaries_anywhere_in_out_dir_are_removed_a_live_ones_kept(
    trained, tmp_path
):
    out = _copy(trained, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        stale = [
            out / f"model_final.safetensors.tmp.{dead.pid}",
            out / f"config.yaml.tmp.{dead.pid}",
            out / "checkpoints" / f"model_epoch_0002_timm.safetensors.tmp.{dead.pid}",
        ]
        live = [
            out / f"model_final_copy.safetensors.tmp.{alive.pid}",  # an export still writing
            out / "checkpoints" / f"model_epoch_0002_torchvision.pth.tmp.{alive.pid}",
        ]
        own = [out / "notes.tmp.txt", out / "tmp.1234"]  # a user's files, named alike
        for path in stale + live + own:
            path.write_bytes(b"half")
        trainer.train_model(tiny_quickstart(out, *_BASE))  # nothing to train: evaluates only
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in live + own)
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("refusal", ["resume", "weights"])
def test_a_refused_run_leaves_a_finished_runs_config_as_it_was(trained, tmp_path, capsys, refusal):
    out = _copy(trained, tmp_path)
    before = (out / "config.yaml").read_bytes()
    if refusal == "resume":  # another model shape: the resume is refused
        args = ["VIT.WIDTH", "64"]
    else:  # a fresh start whose TRAIN.WEIGHTS do not fit the model
        wrong = tmp_path / "wrong.safetensors"
        weights.save_safetensors({"w": torch.zeros(3)}, str(wrong))
        args = ["TRAIN.AUTO_RESUME", "False", "TRAIN.WEIGHTS", str(wrong)]
    status = cli.main(
        ["--mode", "train", "--cfg", QUICKSTART, *TINY, *_BASE, "OUT_DIR", str(out), *args]
    )
    assert status == 2
    assert (out / "config.yaml").read_bytes() == before
    assert not [p for p in os.listdir(out) if ".tmp." in p]


def test_load_json_stats_keeps_the_surviving_timeline(tmp_path):
    lines = [
        {"_type": "train_iter", "epoch": "1/3", "iter": "5/10"},
        {"_type": "train_epoch", "epoch_num": 1},
        {"_type": "train_iter", "epoch": "2/3", "iter": "5/10"},
        {"_type": "train_iter", "epoch": "2/3", "iter": "10/10"},
        {"_type": "train_epoch", "epoch_num": 2},
        {"_type": "resume", "epoch": 1, "iter": 5},  # stopped mid-epoch 2 after 5 steps
        {"_type": "train_iter", "epoch": "2/3", "iter": "10/10"},
        {"_type": "train_epoch", "epoch_num": 2},
    ]
    log = tmp_path / "stdout.log"
    log.write_text("".join(f"[x]: {logs.dump_json_stats(s)}\n" for s in lines))
    kept = logs.load_json_stats(str(log))
    assert kept == lines[:3] + lines[5:]
    assert logs.load_json_stats(str(log), timeline=False) == lines
