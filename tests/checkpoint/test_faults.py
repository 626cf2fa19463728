"""Fault injection: untrusted files, corrupt artefacts, two runs in one OUT_DIR, changed settings
on resume, bad configs, full disks. Each test asserts the exact error class and that nothing was
lost (earlier checkpoints intact, bad files renamed, never deleted)."""

import errno
import io
import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pycls import config
from pycls import distributed as dist
from pycls.checkpoint import files as integrity
from pycls.checkpoint import resume, run_lock
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint import weight_files as weights
from pycls.checkpoint.files import CheckpointWriteError, UntrustedCheckpointError
from pycls.checkpoint.resume import IncompatibleCheckpointError
from pycls.checkpoint.run_lock import RunLock, RunLockedError
from pycls.checkpoint.single_file import CheckpointError
from pycls.checkpoint.unpickle import UnsafePickleError
from pycls.core import cli, trainer
from pycls.core import logging as logs
from pycls.datasets import Cifar, CorruptImageError, Digits, ImageFolder
from pycls.datasets.formats.image_header import declared_size
from pycls.datasets.formats.imagefolder import decode_rgb
from pycls.datasets.formats.prepared_shard_writer import prepare_split
from pycls.datasets.formats.prepared_shards import (
    BAD_IMAGES,
    INDEX_JSON,
    INDEX_NPZ,
    ShardDataset,
    verify_split,
)
from pycls.datasets.loading import checks
from pycls.errors import EXIT_DIVERGED, UserError, describe_write_error
from pycls.models import VisionTransformer
from tests.helpers import (
    QUICKSTART,
    ROOT,
    TINY,
    StopRequested,
    json_stats_of,
    scaled,
    tiny_quickstart,
)
from tests.helpers.warm import run as warm_run

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


def test_yaml_tags_execute_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f'OUT_DIR: !!python/object/apply:os.system ["touch {marker}"]\n')
    assert cli.main(["--mode", "info", "--cfg", str(cfg_file)]) == 2
    assert "cannot parse" in capsys.readouterr().err and not marker.exists()


def test_a_safetensors_header_claiming_gigabytes_allocates_nothing(tmp_path):
    import resource

    path = tmp_path / "claims.safetensors"
    path.write_bytes((2 << 30).to_bytes(8, "little") + b'{"w": {}}')  # a 2 GB header, claimed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(weights.WeightsError, match="cannot read .* as safetensors"):
        weights.read_state_dict(str(path))
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 100_000


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
    # Without a manifest (an older pycls's folder, loaded unverified on request) the metadata's
    # claims are still checked against the files: the truncation is named
    _as_older_pycls(folder)
    with pytest.raises(CheckpointError, match=f"checkpoint {folder}: item .* of __0_0.distcp, wh"):
        sharded_checkpoint.load_model_weights(folder, _small_model(), allow_unverified=True)
    Path(shard).write_bytes(original)  # restored: loads again
    state = sharded_checkpoint.load_model_weights(folder, _small_model(), allow_unverified=True)
    assert state["epoch"] == 1


def _as_older_pycls(folder):
    """The folder as a pycls without manifests wrote it: no manifest, no mention of one."""
    os.remove(os.path.join(folder, integrity.MANIFEST))
    path = os.path.join(folder, sharded_checkpoint.TRAIN_STATE)
    state = checkpoint.load_file(path)
    del state["manifest"]
    checkpoint.save_file(state, path)


def test_deleting_the_manifest_does_not_switch_verification_off(tmp_path, caplog):
    folder = _sharded(tmp_path)
    shard = Path(folder) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.remove(os.path.join(folder, integrity.MANIFEST))
    for allow in (False, True):  # a folder pycls sealed is refused without its manifest
        with pytest.raises(CheckpointError, match="manifest.json is missing, but pycls sealed"):
            sharded_checkpoint.load_model_weights(folder, _small_model(), allow_unverified=allow)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        sharded_checkpoint.read_state(folder)  # what auto-resume reads
    # Another program's DCP folder (no train state): only on request, and said to be unverified
    model = _small_model()
    foreign = str(tmp_path / "foreign")
    torch.distributed.checkpoint.save({"model": model.state_dict()}, checkpoint_id=foreign,
                                      no_dist=True)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"no manifest.json \(not written by pycls\).*"
                       "ALLOW_UNVERIFIED_CHECKPOINTS True"):  # fmt: skip
        sharded_checkpoint.load_model_weights(foreign, _small_model())
    loaded = _small_model()
    with caplog.at_level(logging.WARNING):
        sharded_checkpoint.load_model_weights(foreign, loaded, allow_unverified=True)
    assert "no manifest.json (not written by pycls); loaded UNVERIFIED" in caplog.text
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    # An older pycls's folder likewise
    older = _sharded(tmp_path / "older")
    _as_older_pycls(older)
    with pytest.raises(CheckpointError, match=r"\(written by an older pycls\)"):
        sharded_checkpoint.load_model_weights(older, _small_model())
    assert sharded_checkpoint.load_model_weights(older, _small_model(), True)["epoch"] == 1


def test_sharded_write_error_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    first = _sharded(tmp_path, epoch=1)
    before = integrity.read_manifest(first)
    import torch.distributed.checkpoint as dcp

    def full(*args, checkpoint_id, **kwargs):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"part of a shard")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(CheckpointWriteError, match=r"model_epoch_0002\.tmp: No space left"):
        _sharded(tmp_path, epoch=2)
    assert integrity.verify_manifest(first) and integrity.read_manifest(first) == before
    second = checkpoint.get_checkpoint_path(str(tmp_path), 2, sharded=True)
    # The partial folder is gone too: it would hold the disk full until the next start
    assert not os.path.exists(second) and not os.path.exists(f"{second}.tmp")


def test_a_full_disk_is_named_whatever_the_writer_says(tmp_path, monkeypatch):
    """torch's zip writer says "unexpected pos" and a failure in another process arrives without
    its OSError: a failed write on a full file system still says the disk is full."""
    zip_writer = RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )
    path = str(tmp_path / "checkpoints" / "model_epoch_0002.tmp")
    assert describe_write_error(path, zip_writer).endswith(f"{zip_writer}")  # space left here
    remote = RuntimeError("Traceback (RANK 1)\n ...\nOSError: [Errno 28] No space left on device")
    full = f"cannot write {path}: No space left on device (free some space or choose another"
    assert describe_write_error(path, remote).startswith(full)
    monkeypatch.setattr(os, "statvfs", lambda p: type("st", (), {"f_bavail": 3, "f_frsize": 4096}))
    assert describe_write_error(path, zip_writer).startswith(full)
    assert describe_write_error(path, zip_writer).endswith("[ENOSPC]")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KB file system (tmpfs), where a checkpoint does not fit; skipped where mounting one
    is not allowed (it needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize(
    "layout", ["single file (none, ddp, fairscale)", "sharded (fsdp, pipeline)"]
)
def test_a_really_full_disk_is_named_and_leaves_nothing_partial(tiny_disk, layout):
    model = VisionTransformer(image_size=16, patch_size=4, depth=2, width=64, num_heads=2,
                              mlp_dim=128, num_classes=10)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters())
    out = str(tiny_disk)
    with pytest.raises(CheckpointWriteError) as e:
        if layout.startswith("single"):
            state = {"model_state": model.state_dict(), "optimizer_state": optimizer.state_dict()}
            checkpoint.save_file(state, checkpoint.get_checkpoint_path(out, 1))
        else:
            sharded_checkpoint.save_sharded(out, 1, module=model, optimizer=optimizer, cfg_yaml="")
    assert "No space left on device (free some space or choose another OUT_DIR) [ENOSPC]" in str(
        e.value
    )
    assert os.listdir(tiny_disk / "checkpoints") == []


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


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")  # as a write or flush says it: no file


def test_a_full_disk_while_taking_the_lock_names_it_and_leaves_no_lock(tmp_path, monkeypatch):
    """Broke when a full disk at start failed the lock's write with "No space left on device"
    naming no file and left an empty run.lock, which then refused every later run there as "in
    use by another run: host ?, pid ?": the error names the lock and no lock is left."""
    monkeypatch.setattr(run_lock.os, "fsync", _enospc)
    with pytest.raises(OSError) as caught:
        RunLock(str(tmp_path)).acquire()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(
        tmp_path / run_lock.LOCK_FILE
    )
    monkeypatch.undo()
    assert not (tmp_path / run_lock.LOCK_FILE).exists()
    RunLock(str(tmp_path)).acquire().release()  # the disk freed, the next run starts


def test_an_atomic_write_on_a_full_disk_names_its_file(tmp_path, monkeypatch):
    """Every atomic writer (config.yaml, _info.json, weights) names the file a full disk failed:
    a write or flush raises an OSError without a file name (broke: "No space left on device"
    alone); the earlier file stays whole."""
    from pycls import atomic_files

    target = tmp_path / "config.yaml"
    target.write_text("earlier")
    monkeypatch.setattr(atomic_files.os, "fsync", _enospc)
    with pytest.raises(OSError) as caught:
        atomic_files.write_text_atomic(target, "new")
    assert caught.value.filename == str(target) and caught.value.errno == errno.ENOSPC
    assert target.read_text() == "earlier" and os.listdir(tmp_path) == ["config.yaml"]


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
    with pytest.raises(checks.ClassMismatchError) as e:
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
    listed = (out / checks.SKIPPED_FILES).read_text().splitlines()
    assert len(listed) == 1 and str(bad) in listed[0]
    log = (out / logs.LOG_FILE).read_text()
    assert f"skipped a corrupt sample: cannot decode image {bad}" in log
    # Evaluating with a test split of other classes than the checkpoint's is refused too
    shutil.rmtree(data / "val" / "c1")
    test = ["TEST.WEIGHTS", checkpoint.get_checkpoint_path(str(out), 1), *skip]
    with pytest.raises(checks.ClassMismatchError, match="missing from the test split: c1"):
        trainer.test_model(tiny_quickstart(tmp_path / "test", *_FOLDER, *_SMALL, *test))


def _bad_files(folder, names):
    for name in names:  # bytes: a file name need not be UTF-8
        with open(os.path.join(os.fsencode(folder), name), "wb") as f:
            f.write(b"not a png")


_ODD_NAMES = [b"bad\xff.png", b"two\nlines.png"]


def test_file_names_of_any_bytes_are_escaped_in_logs_lists_and_errors(tmp_path):
    """A corrupt image named with bytes that are not UTF-8, another with a newline, in an OUT_DIR
    that is not UTF-8 either: the run skips both, names each on one escaped line in the log and
    in skipped_files.txt, and json_stats keep the exact bytes of the checkpoint's path."""
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "val/c0", "val/c1"], per_class=4)
    _image_folder(data, ["train/c1"], per_class=2)
    _bad_files(data / "train" / "c1", _ODD_NAMES)
    out = os.fsdecode(os.fsencode(tmp_path) + b"/run\xfe")
    skip = ["DATA_LOADER.SKIP_CORRUPT", "True", "DATA.PATH", str(data)]
    skip += ["DATA_LOADER.NUM_WORKERS", "1"]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    where = f"{data}/train/c1/"
    listed = (Path(out) / checks.SKIPPED_FILES).read_bytes().decode("utf-8").splitlines()
    assert sorted(line.split(":")[0] for line in listed) == [
        f"cannot decode image {where}bad\\xff.png",
        f"cannot decode image {where}two\\nlines.png",
    ]
    log = (Path(out) / logs.LOG_FILE).read_bytes().decode("utf-8")
    for name in ("bad\\xff.png", "two\\nlines.png"):
        assert f"skipped a corrupt sample: cannot decode image {where}{name}: " in log
    assert "run\\xfe/checkpoints/model_epoch_0001.pyth" in log
    # A resume's json_stats line carries the checkpoint's path with its exact bytes
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip, "OPTIM.MAX_EPOCH", "2"))
    (resumed,) = json_stats_of(out, "resume")
    assert os.fsencode(resumed["checkpoint"]).startswith(os.fsencode(out) + b"/checkpoints/")
    # Without SKIP_CORRUPT the error is one line naming the file
    bad = os.fsdecode(os.path.join(os.fsencode(data / "train" / "c1"), _ODD_NAMES[1]))
    with pytest.raises(CorruptImageError) as e:
        decode_rgb(bad)
    assert str(e.value).startswith(f"cannot decode image {where}two\\nlines.png: ")
    assert "\n" not in str(e.value)
    assert UserError(f"cannot read {out}").one_line().endswith("run\\xfe")


def test_prepared_shards_list_odd_file_names_escaped(tmp_path):
    """tools/prepare_dataset.py's bad_images.txt: one escaped line per unreadable file."""
    data = tmp_path / "data"
    _image_folder(data, ["train/c0"], per_class=2)
    _bad_files(data / "train" / "c0", _ODD_NAMES)
    folder = tmp_path / "shards" / "train"
    result = prepare_split(ImageFolder(data, "train"), folder, dataset="imagefolder",
                           split="train", size=8)  # fmt: skip
    assert result.num_samples == 2
    lines = (folder / BAD_IMAGES).read_bytes().decode("utf-8").splitlines()
    names = sorted(line.split("\t")[0].rsplit("/", 1)[1] for line in lines)
    assert names == ["bad\\xff.png", "two\\nlines.png"]


def test_skipped_files_lists_a_file_once_across_a_resume(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "val/c0", "val/c1"], per_class=4)
    _image_folder(data, ["train/c1"], per_class=3)
    _bad_files(data / "train" / "c1", [b"bad.png"])
    out = tmp_path / "run"
    skip = ["DATA_LOADER.SKIP_CORRUPT", "True", "DATA.PATH", str(data)]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip, "OPTIM.MAX_EPOCH", "2"))
    assert len(json_stats_of(out, "resume")) == 1
    assert sum(s["num_skipped"] for s in json_stats_of(out, "train_epoch")) == 2  # each epoch
    (line,) = (out / checks.SKIPPED_FILES).read_text().splitlines()
    assert line.startswith(f"cannot decode image {data}/train/c1/bad.png: ")


def _pil_bytes(size, fmt, **options):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(buffer, fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "fmt, options",
    [("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("GIF", {}),
     ("WEBP", {}), ("WEBP", {"lossless": True}), ("WEBP", {"exif": b"Exif\0\0MM"}),
     ("BMP", {}), ("TIFF", {}), ("PPM", {})],
)  # fmt: skip
def test_image_headers_declare_the_size_the_decoder_gives(fmt, options):
    from pycls.datasets.formats import decode

    data = _pil_bytes((37, 23), fmt, **options)
    assert declared_size(data) == (37, 23)
    decoded = decode.decode_rgb(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert tuple(decoded.shape[-2:]) == (23, 37)


def test_a_bomb_in_a_format_pil_sizes_is_refused_too(tmp_path):
    from PIL import Image

    bomb = tmp_path / "bomb.tif"  # 400 million pixels in 330 KB: more than PIL itself opens
    Image.new("1", (20_000, 20_000)).save(bomb, "TIFF", compression="tiff_lzw")
    with pytest.raises(CorruptImageError, match="declares more than 178,956,970 pixels"):
        decode_rgb(str(bomb))


def _png_bomb(path, side=10_000):
    """A real PNG of side x side pixels (100 million: 300 MB as RGB) in a few kilobytes."""
    from PIL import Image

    Image.new("1", (side, side)).save(path, "PNG")


def test_decompression_bomb_is_refused_before_decoding_naming_file_and_size(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "train/c1", "val/c0", "val/c1"], per_class=4)
    bomb = data / "train" / "c1" / "bomb.png"
    _png_bomb(bomb)
    assert bomb.stat().st_size < 100_000
    why = "it declares 10000 x 10000 = 100,000,000 pixels, more than the limit of 89,478,485"
    with pytest.raises(CorruptImageError, match=f"^refusing image {bomb}: {why} "):
        decode_rgb(str(bomb))
    out = tmp_path / "run"
    skip = ["DATA_LOADER.SKIP_CORRUPT", "True", "DATA.PATH", str(data)]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    listed = (out / checks.SKIPPED_FILES).read_text().splitlines()
    assert len(listed) == 1 and listed[0].startswith(f"refusing image {bomb}: {why}")
    # The limit is a key; a lower one refuses the small images too
    with pytest.raises(config.ConfigError, match="DATA_LOADER.MAX_IMAGE_PIXELS: must be >= 0"):
        tiny_quickstart(out, "DATA_LOADER.MAX_IMAGE_PIXELS", "-1")
    small = tiny_quickstart(tmp_path / "r2", *_FOLDER, *_SMALL, "DATA.PATH", str(data),
                            "DATA_LOADER.MAX_IMAGE_PIXELS", "255")  # fmt: skip
    with pytest.raises(CorruptImageError, match="declares 16 x 16 = 256 pixels"):
        trainer.train_model(small)


def test_prepare_dataset_lists_a_bomb_as_bad(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0"], per_class=2)
    _png_bomb(data / "train" / "c0" / "bomb.png")
    tool = os.path.join(ROOT, "tools", "prepare_dataset.py")
    out = tmp_path / "shards"
    cmd = [sys.executable, tool, "--dataset", "imagefolder", "--data", str(data), "--out",
           str(out), "--splits", "train", "--size", "8", "--workers", "1"]  # fmt: skip
    done = warm_run(cmd, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    (line,) = (out / "train" / BAD_IMAGES).read_text().splitlines()
    assert line.startswith(f"{data}/train/c0/bomb.png\trefusing image ")
    assert "declares 10000 x 10000" in line


def test_shard_jpeg_over_the_limit_is_refused_or_skipped_on_the_device_path(tmp_path):
    from pycls.datasets.loading.gpu_augment import (
        DeviceAugment,
        DeviceAugmentBatches,
        DeviceAugmentDataset,
        construct_device_loader,
    )

    source = torch.utils.data.Subset(Digits("train"), range(6))
    folder = tmp_path / "shards" / "train"
    prepare_split(source, folder, dataset="digits", split="train", fmt="jpeg", size=8)
    for decode in (True, False):  # decoded in the loader, or on the device
        with pytest.raises(CorruptImageError, match="declares 8 x 8 = 64 pixels, more than .* 63"):
            ShardDataset(folder.parent, "train", decode=decode, max_pixels=63)[2]
    base = ShardDataset(folder.parent, "train", decode=False, max_pixels=63)
    dataset = DeviceAugmentDataset(base, DeviceAugment("none", True), True, skip_corrupt=True)
    loader = construct_device_loader(
        dataset, batch_size=4, shuffle=False, drop_last=False, num_workers=0, pin_memory=False,
        persistent_workers=False, prefetch_factor=2, seed=0, image_size=8, skip_corrupt=True,
    )  # fmt: skip
    batches = list(DeviceAugmentBatches(loader, "cpu", (0.5,) * 3, (0.2,) * 3, dataset.augment))
    assert [(len(images), int(skipped)) for images, _, skipped in batches] == [(0, 4), (0, 2)]
    assert all("declares 8 x 8" in r for _, _, skipped in batches for r in skipped.reasons)


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
    result = warm_run(cmd)
    assert result.returncode == 1 and "shard_00001.bin is corrupt" in result.stderr


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


def test_nested_class_list_is_a_one_line_config_error(capsys):
    overrides = [*TINY, "DATA.CLASSES", "[[1, 2], [3]]"]
    with pytest.raises(config.ConfigError, match=r"^DATA.CLASSES: holds \[1, 2\], but its"):
        config.load_cfg(QUICKSTART, overrides)
    assert cli.main(["--mode", "info", "--cfg", QUICKSTART, *overrides]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "config error: DATA.CLASSES: holds [1, 2], but its values are numbers"


def test_a_key_written_twice_in_a_yaml_file_names_the_key_and_both_lines(tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "OPTIM:\n  BASE_LR: 0.1\n  MAX_EPOCH: 2\n  BASE_LR: 0.5\nVIT:\n  DEPTH: 1\n"
    )
    assert cli.main(["--mode", "info", "--cfg", str(cfg_file)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"config error: --cfg: {cfg_file}: key 'BASE_LR' appears twice in one section "
        "(lines 2 and 4); keep one"
    )
    # The same key in two sections is two keys
    cfg_file.write_text("OPTIM:\n  MAX_EPOCH: 2\nCURRICULUM:\n  MAX_EPOCH: 0\n")
    with pytest.raises(config.ConfigError, match="CURRICULUM.MAX_EPOCH"):  # (not a key there)
        config.load_cfg(str(cfg_file))


def test_a_diverged_run_stops_in_one_line_with_its_own_exit_status(tmp_path, capsys):
    args = ["--mode", "train", "--cfg", QUICKSTART, *TINY, "OUT_DIR", str(tmp_path)]
    args += ["OPTIM.OPTIMIZER", "sgd", "OPTIM.BASE_LR", "1e12", "OPTIM.WARMUP_EPOCHS", "0"]
    assert cli.main(args) == EXIT_DIVERGED == 3
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(r"error: loss is (nan|inf) at epoch 1, iteration \d+ \(AMP.LEVEL=", line)
    assert checkpoint.get_last_checkpoint(str(tmp_path)) is None


def test_weights_file_errors_are_one_line_naming_the_key_the_user_gave(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    base = ["--cfg", QUICKSTART, *TINY, "OUT_DIR", str(tmp_path / "run")]
    for mode, key in (("test", "TEST.WEIGHTS"), ("train", "TRAIN.WEIGHTS")):
        assert cli.main(["--mode", mode, *base, key, str(bad)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: {key}: cannot read {bad} as safetensors: ")


def test_weights_of_another_dtype_are_converted_if_lossless_and_logged_else_refused(
    tmp_path, caplog
):
    model = _small_model()
    state = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    half = tmp_path / "half.safetensors"
    weights.save_safetensors(state, str(half))
    loaded = _small_model()
    with caplog.at_level(logging.INFO):
        weights.load_weights(str(half), loaded, naming="pycls")
    assert f"{half}: {len(state)} tensors converted from torch.float16 to torch.float32" in (
        caplog.text
    )
    assert all(torch.equal(loaded.state_dict()[k].half(), v) for k, v in state.items())
    wide = tmp_path / "double.safetensors"
    weights.save_safetensors({k: v.double() for k, v in model.state_dict().items()}, str(wide))
    with pytest.raises(weights.WeightsError, match="dtypes that would lose precision: .*float64"):
        weights.load_weights(str(wide), _small_model(), naming="pycls", key="TEST.WEIGHTS")


def _train_until(out, kind, *args):
    """A tools/run_net.py training run, returned once it logs its first ``kind`` line."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "run_net.py"), "--mode", "train", "--cfg",
           QUICKSTART, *TINY, "DEVICE", "cpu", "OUT_DIR", str(out), *args]  # fmt: skip
    # A session of its own: Ctrl-C at a terminal signals the whole process group (os.killpg)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_RUN_ENV, cwd=ROOT, start_new_session=True)  # fmt: skip
    for line in proc.stdout:
        if f'"{kind}"' in line:
            return proc
    raise AssertionError(f"no {kind} line: {proc.wait()}")


def _ctrl_c(proc):
    os.killpg(proc.pid, signal.SIGINT)


_RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


@pytest.mark.slow
@pytest.mark.parametrize("procs", ["1", "2"])  # NUM_PROCS 2: the parent and both children get it
def test_first_ctrl_c_stops_with_a_checkpoint_like_a_preemption(tmp_path, procs):
    out = tmp_path / "run"
    args = ["OPTIM.MAX_EPOCH", "3", "LOG_PERIOD", "2", "NUM_PROCS", procs, "TRAIN.PARALLEL", "ddp"]
    proc = _train_until(out, "train_iter", *args)
    _ctrl_c(proc)
    rest = proc.stdout.read()
    assert proc.wait(timeout=scaled(300)) == 130, rest[-3000:]
    assert rest.count("Ctrl-C: stopping at the next sync point with a checkpoint") == 1
    assert "stopping on Ctrl-C after epoch" in rest and "Traceback" not in rest
    last = checkpoint.get_last_checkpoint(str(out))
    assert last is not None and "_iter_" in last and not (out / "run.lock").exists()
    if procs != "1":
        return
    done = subprocess.run(proc.args, capture_output=True, text=True, timeout=scaled(300), cwd=ROOT,
                          env=_RUN_ENV)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json_stats_of(out, "resume")[0]["checkpoint"] == last


@pytest.mark.slow
def test_second_ctrl_c_aborts_at_once_in_one_line(tmp_path):
    out = tmp_path / "run"
    # Only epoch ends are sync points here, 176 steps (~2 s) apart: both presses come mid-epoch
    args = ["OPTIM.MAX_EPOCH", "50", "LOG_PERIOD", "100000", "TRAIN.BATCH_SIZE", "8"]
    proc = _train_until(out, "train_epoch", *args)
    time.sleep(0.3)
    _ctrl_c(proc)
    time.sleep(0.3)
    _ctrl_c(proc)
    rest = proc.stdout.read()
    assert proc.wait(timeout=scaled(120)) == 130, rest[-3000:]
    assert "interrupted: stopped at once by Ctrl-C" in rest and "Traceback" not in rest
    last = checkpoint.get_last_checkpoint(str(out))  # no mid-epoch checkpoint
    assert last is None or "_iter_" not in last


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


def test_a_changed_cnn_architecture_key_is_refused_on_resume():
    """A CNN's shape comes from its family's keys (REGNET.W0 ...), not the VIT ones."""
    from pycls.core import resume_checks

    stored = config.load_cfg(None, ["MODEL.TYPE", "regnet", "REGNET.W0", "24"])
    now = config.load_cfg(None, ["MODEL.TYPE", "regnet", "REGNET.W0", "32"])
    with pytest.raises(IncompatibleCheckpointError, match=r"REGNET\.W0: 24 -> 32"):
        resume_checks.check_compatible("ckpt.pyth", {"cfg": stored.dump()}, now)
    resume_checks.check_compatible("ckpt.pyth", {"cfg": now.dump()}, now)  # unchanged: fine
