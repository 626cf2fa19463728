"""Fault injection: untrusted files, corrupt artefacts, two runs in one OUT_DIR, changed settings
on resume, bad configs, full disks. Each test asserts the exact error class and that nothing was
lost (earlier checkpoints intact, bad files renamed, never deleted)."""

import errno
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import QUICKSTART, ROOT, json_stats_of, tiny_quickstart

from pycls.checkpoint import files as integrity
from pycls.checkpoint import run_lock
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint.files import CheckpointWriteError, UntrustedCheckpointError
from pycls.checkpoint.resume import IncompatibleCheckpointError
from pycls.checkpoint.run_lock import RunLock, RunLockedError
from pycls.checkpoint.single_file import CheckpointError
from pycls.checkpoint.unpickle import UnsafePickleError
from pycls.core import cli, config, trainer
from pycls.core import logging as logs
from pycls.datasets import Cifar, CorruptImageError, Digits
from pycls.datasets.shards import INDEX_JSON, INDEX_NPZ, ShardDataset, prepare_split, verify_split
from pycls.models import VisionTransformer

pytestmark = pytest.mark.usefixtures("single_thread")


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _small_model():
    return VisionTransformer(
        image_size=16, patch_size=4, depth=1, width=32, num_heads=2, mlp_dim=32, num_classes=3
    )


def _sharded(tmp_path, epoch=1):
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters())
    return sharded_checkpoint.save_sharded(
        str(tmp_path), epoch, module=model, optimizer=opt, cfg_yaml=""
    )


# ------------------------------------------------------------------------------------------------ #
# Untrusted input executes nothing
# ------------------------------------------------------------------------------------------------ #


def test_the_payload_runs_under_plain_pickle(tmp_path):
    """The control: the payload below is real (plain pickle.load would run it)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("with_manifest", [False, True])
def test_crafted_dcp_metadata_executes_nothing(tmp_path, with_manifest):
    folder = _sharded(tmp_path)
    marker = tmp_path / "ran"
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    if with_manifest:  # a crafted folder can carry a matching manifest: not a defence by itself
        integrity.write_manifest(folder)
    else:
        os.remove(os.path.join(folder, integrity.MANIFEST))
    # TEST.WEIGHTS / TRAIN.WEIGHTS, consolidation and auto-resume all read it the same way
    for load in (
        lambda: sharded_checkpoint.load_model_weights(folder, _small_model()),
        lambda: sharded_checkpoint.consolidate(folder),
    ):
        with pytest.raises(UntrustedCheckpointError, match=r"\.metadata: refusing to load posix"):
            load()
    assert not marker.exists()


def test_crafted_cifar_batch_executes_nothing(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "ran"
    good = {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 1]}
    for name in [f"data_batch_{i}" for i in range(1, 6)]:
        entry = {**good, "labels": _Payload(marker)} if name == "data_batch_3" else good
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
    with pytest.raises(UnsafePickleError, match="data_batch_3: refusing to load posix.system"):
        Cifar(tmp_path, "train")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ #
# Sharded checkpoints carry a manifest
# ------------------------------------------------------------------------------------------------ #


def test_sharded_checkpoint_flipped_byte_and_truncation_are_named(tmp_path):
    folder = _sharded(tmp_path)
    shard = os.path.join(folder, "__0_0.distcp")
    original = Path(shard).read_bytes()
    for offset in (0, len(original) // 3, len(original) - 1):  # header, tensor data, trailer
        data = bytearray(original)
        data[offset] ^= 0xFF
        Path(shard).write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupt: .* CRC32"):
            sharded_checkpoint.load_model_weights(folder, _small_model())
    Path(shard).write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is \d+ bytes, \d+ were written"):
        sharded_checkpoint.load_model_weights(folder, _small_model())
    # Without a manifest (an older folder) DCP's own exception is wrapped, naming the folder
    os.remove(os.path.join(folder, integrity.MANIFEST))
    with pytest.raises(CheckpointError, match=f"checkpoint {folder} cannot be loaded"):
        sharded_checkpoint.load_model_weights(folder, _small_model())
    Path(shard).write_bytes(original)  # restored: loads again
    assert sharded_checkpoint.load_model_weights(folder, _small_model())["epoch"] == 1


def test_sharded_write_error_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    first = _sharded(tmp_path, epoch=1)
    before = integrity.read_manifest(first)
    import torch.distributed.checkpoint as dcp

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(CheckpointWriteError, match=r"model_epoch_0002\.tmp: No space left"):
        _sharded(tmp_path, epoch=2)
    assert integrity.verify_manifest(first) and integrity.read_manifest(first) == before
    assert not os.path.exists(checkpoint.get_checkpoint_path(str(tmp_path), 2, sharded=True))


# ------------------------------------------------------------------------------------------------ #
# A trained run to break in various ways (2 tiny epochs, a checkpoint after each)
# ------------------------------------------------------------------------------------------------ #

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


def test_log_file_write_error_is_reported_once(tmp_path, capsys):
    logs.setup_logging(str(tmp_path))
    handler = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)][0]

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    handler.stream = Full()
    for i in range(5):
        logs.log_json_stats({"_type": "x", "i": i})
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("No space left on device") == 1 and str(tmp_path / logs.LOG_FILE) in err
    handler.stream = None  # nothing to close


def test_dead_writers_temporaries_are_removed_and_nothing_else(trained, tmp_path):
    out = _copy(trained, tmp_path)
    ckpts = out / "checkpoints"
    (ckpts / "model_epoch_0002.pyth.tmp.6482").write_bytes(b"half")
    (ckpts / "model_epoch_0003.tmp").mkdir()
    (ckpts / "model_epoch_0003.tmp" / "__0_0.distcp").write_bytes(b"half")
    kept = sorted(p.name for p in ckpts.iterdir() if ".tmp" not in p.name)
    trainer.train_model(tiny_quickstart(out, *_BASE))  # nothing to train: evaluates only
    assert sorted(p.name for p in ckpts.iterdir()) == kept


# ------------------------------------------------------------------------------------------------ #
# One run per OUT_DIR
# ------------------------------------------------------------------------------------------------ #


def test_second_run_is_refused_naming_the_holder(tmp_path):
    holder = f"host {socket.gethostname()}, pid {os.getpid()}"
    with RunLock(str(tmp_path)), pytest.raises(RunLockedError, match=holder):
        RunLock(str(tmp_path)).acquire()
    RunLock(str(tmp_path)).acquire().release()  # free again once released


def test_second_training_run_stops_before_writing_anything(tmp_path):
    out = tmp_path / "run"
    with RunLock(str(out)):
        with pytest.raises(RunLockedError, match="in use by another run"):
            trainer.train_model(tiny_quickstart(out))
        assert sorted(os.listdir(out)) == [run_lock.LOCK_FILE]  # no config.yaml, no log


def test_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    info = {"host": socket.gethostname(), "pid": dead.pid, "start_time": time.time() - 60}
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING):
        lock = RunLock(str(tmp_path)).acquire()
    assert "took over the stale lock" in caplog.text and f"pid {dead.pid}" in caplog.text
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / run_lock.LOCK_FILE).exists()


def test_lock_of_another_host_is_never_taken_over(tmp_path):
    info = {"host": "elsewhere", "pid": 1, "start_time": time.time()}
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(info))
    with pytest.raises(RunLockedError, match="host elsewhere, pid 1"):
        RunLock(str(tmp_path)).acquire()
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text()) == info


# ------------------------------------------------------------------------------------------------ #
# Data: class lists, corrupt images named, shards with checksums
# ------------------------------------------------------------------------------------------------ #


def _image_folder(root, classes, per_class=2):
    from torchvision.io import write_png

    for cls in classes:
        split, name = cls.split("/")
        (root / split / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = torch.full((3, 16, 16), 40 * i + 10 * len(name), dtype=torch.uint8)
            write_png(image, str(root / split / name / f"{i}.png"))


_FOLDER = ["TRAIN.DATASET", "imagefolder", "TEST.DATASET", "imagefolder", "TEST.SPLIT", "val"]
_SMALL = ["TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1"]


def test_test_split_with_other_classes_is_an_error_listing_them(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "train/c1", "train/c2", "val/c0", "val/c2", "val/c3"])
    cfg = tiny_quickstart(tmp_path / "run", *_FOLDER, *_SMALL, "DATA.PATH", str(data))
    with pytest.raises(integrity.ClassMismatchError) as e:
        trainer.Trainer(cfg, trainer.setup_env(cfg))
    assert "missing from the test split: c1" in str(e.value)
    assert "not in the training split: c3" in str(e.value)


def test_class_list_is_stored_and_skipped_files_are_named(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "train/c1", "val/c0", "val/c1"], per_class=4)
    bad = data / "train" / "c1" / "9.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "run"
    skip = [
        "DATA_LOADER.SKIP_CORRUPT",
        "True",
        "DATA.PATH",
        str(data),
        "DATA_LOADER.NUM_WORKERS",
        "1",
    ]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    state = checkpoint.load_file(checkpoint.get_checkpoint_path(str(out), 1))
    assert state["classes"] == ["c0", "c1"]
    listed = (out / integrity.SKIPPED_FILES).read_text().splitlines()
    assert len(listed) == 1 and str(bad) in listed[0]
    log = (out / logs.LOG_FILE).read_text()
    assert f"skipped a corrupt sample: cannot decode image {bad}" in log
    # Evaluating with a test split of other classes than the checkpoint's is refused too
    shutil.rmtree(data / "val" / "c1")
    test = ["TEST.WEIGHTS", checkpoint.get_checkpoint_path(str(out), 1), *skip]
    with pytest.raises(integrity.ClassMismatchError, match="missing from the test split: c1"):
        trainer.test_model(tiny_quickstart(tmp_path / "test", *_FOLDER, *_SMALL, *test))


@pytest.fixture
def shards(tmp_path):
    source = torch.utils.data.Subset(Digits("train"), range(40))
    folder = tmp_path / "shards" / "train"
    prepare_split(source, folder, dataset="digits", split="train", shard_size=10)
    return folder


def test_flipped_shard_byte_is_a_corrupt_image_naming_shard_and_index(shards):
    shard = shards / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[3 * 192 + 5] ^= 0x10  # sample 13: the fourth of shard 1 (raw 8x8 images, 192 bytes)
    shard.write_bytes(bytes(data))
    ds = ShardDataset(shards.parent, "train")  # sizes are right: opens
    with pytest.raises(CorruptImageError, match=f"corrupt sample 13 of shard {shard}: .*CRC32"):
        ds[13]
    assert ds[12][1] == int(Digits("train").labels[12])  # the others read fine
    problems = verify_split(shards)
    assert len(problems) == 1 and "shard_00001.bin is corrupt" in problems[0]
    tool = os.path.join(ROOT, "tools", "prepare_dataset.py")
    cmd = [sys.executable, tool, "--verify", "--out", str(shards.parent)]
    result = subprocess.run(cmd, capture_output=True)
    assert result.returncode == 1 and b"shard_00001.bin is corrupt" in result.stderr


def test_truncated_shard_fails_at_open_or_is_skipped(shards):
    shard = shards / "shard_00002.bin"
    shard.write_bytes(shard.read_bytes()[:500])
    with pytest.raises(integrity.CorruptFileError, match=f"shard {shard} is 500 bytes, 1920 were"):
        ShardDataset(shards.parent, "train")
    with pytest.warns(UserWarning, match="skipped"):
        ds = ShardDataset(shards.parent, "train", skip_corrupt=True)
    with pytest.raises(CorruptImageError, match=f"sample 23 of shard {shard}: .*truncated"):
        ds[23]


@pytest.mark.parametrize("name, garbage", [(INDEX_JSON, b"{not json"), (INDEX_NPZ, None)])
def test_garbled_shard_index_is_named(shards, name, garbage):
    path = shards / name
    path.write_bytes(garbage if garbage is not None else path.read_bytes()[:100])
    with pytest.raises(integrity.CorruptFileError, match=f"{path}"):
        ShardDataset(shards.parent, "train")


# ------------------------------------------------------------------------------------------------ #
# Configs, and the surviving timeline of json_stats
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize(
    "yaml_text, overrides, match",
    [
        (None, ["TRAIN.ACCUM_STEPS", "0"], "TRAIN.ACCUM_STEPS: must be > 0"),
        ("OPTIM:\n  BASE_LR: .inf\n", [], "OPTIM.BASE_LR: must be a finite number"),
        ("OPTIM:\n  BETAS: [0.9, .nan]\n", [], "OPTIM.BETAS: must be a finite number"),
        (None, ["OPTIM.EPS", "1e400"], "OPTIM.EPS: must be a finite number"),
        ("# nothing\n", [], "is empty"),
        ("DIR", [], "is a directory"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, capsys, yaml_text, overrides, match):
    cfg_file = QUICKSTART
    if yaml_text == "DIR":
        cfg_file = str(tmp_path)
    elif yaml_text is not None:
        cfg_file = str(tmp_path / "c.yaml")
        Path(cfg_file).write_text(yaml_text)
    with pytest.raises(config.ConfigError, match=match):
        config.load_cfg(cfg_file, overrides)
    assert cli.main(["--mode", "info", "--cfg", cfg_file, *overrides]) == 2
    assert match in capsys.readouterr().err


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
