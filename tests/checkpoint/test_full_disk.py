"""A full disk: every failed write names its file and the disk, in one message, and loses
nothing (earlier checkpoints intact, no partial file or folder left, the earlier file of an atomic
write whole); a log file that cannot be written is reported once."""

import errno
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from pycls.checkpoint import files as integrity
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint.files import CheckpointWriteError
from pycls.core import logging as logs
from pycls.errors import describe_write_error
from pycls.models import VisionTransformer

pytestmark = pytest.mark.usefixtures("single_thread")


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


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")  # as a write or flush says it: no file


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
