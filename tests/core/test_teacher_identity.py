"""A distilled run records its teacher (DISTILL.TEACHER and the SHA-256 of its weights) in every
checkpoint and its log; a resume whose teacher's weights changed since is refused naming both, or
with DISTILL.ALLOW_TEACHER_CHANGE goes on and logs it. The digest is cached by size, modification
and change times and inode (pycls.checkpoint.file_digest): a same-size rewrite whose modification
time was set back is hashed again."""

import hashlib
import os

import pytest
import torch

from pycls import config
from pycls.checkpoint import file_digest, sharded, single_file, weight_files
from pycls.core import builders
from pycls.core.trainer import train_model
from tests.helpers import QUICKSTART, TINY

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


def _cfg(out_dir, *overrides):
    return config.load_cfg(QUICKSTART, [*TINY, "OUT_DIR", str(out_dir), *overrides])


def _write_teacher(path, seed):
    cfg = _cfg(os.path.dirname(path))
    torch.manual_seed(seed)
    model = builders.build_model(cfg)
    weight_files.save_safetensors(model.state_dict(), str(path), {"naming": "pycls",
                                                                  "cfg": cfg.dump()})  # fmt: skip
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sha_of_checkpoint(out_dir, epoch):
    state = sharded.read_state(single_file.get_checkpoint_path(str(out_dir), epoch))
    return state["teacher"]["sha256"]


def test_a_resume_with_another_teacher_is_refused_or_logged_when_allowed(tmp_path):
    teacher = tmp_path / "teacher" / "model_final.safetensors"
    teacher.parent.mkdir()
    first = _write_teacher(teacher, seed=5)
    common = ["DISTILL.TYPE", "hard", "DISTILL.TEACHER", str(teacher), "TRAIN.EVAL_PERIOD", "1",
              "TRAIN.CHECKPOINT_PERIOD", "1"]  # fmt: skip
    out = tmp_path / "student"
    train_model(_cfg(out, *common, "OPTIM.MAX_EPOCH", "1"))
    assert _sha_of_checkpoint(out, 1) == first
    assert f"its weights: {teacher} (sha256 {first})" in (out / "stdout.log").read_text()
    second = _write_teacher(teacher, seed=6)  # replaced between the stop and the resume
    with pytest.raises(config.ConfigError) as err:
        train_model(_cfg(out, *common, "OPTIM.MAX_EPOCH", "2"))
    line = str(err.value)
    assert (
        line.startswith("DISTILL.TEACHER: the teacher's weights differ from those")
        and "\n" not in line
    )
    assert first in line and second in line and "DISTILL.ALLOW_TEACHER_CHANGE True" in line
    assert not os.path.exists(single_file.get_checkpoint_path(str(out), 2))
    train_model(_cfg(out, *common, "OPTIM.MAX_EPOCH", "2", "DISTILL.ALLOW_TEACHER_CHANGE", "True"))
    assert "going on with the new one" in (out / "stdout.log").read_text()
    assert _sha_of_checkpoint(out, 2) == second


def test_the_digest_is_cached_by_size_and_modification_time(tmp_path, monkeypatch):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    hashed = []
    real = file_digest._hash_file
    monkeypatch.setattr(file_digest, "_hash_file", lambda p: hashed.append(p) or real(p))
    cache = tmp_path / "cache"
    want = hashlib.sha256(b"a" * 1000).hexdigest()
    assert file_digest.digest(str(path), cache) == file_digest.digest(str(path), cache) == want
    assert len(hashed) == 1  # the second from the cache
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(1, 10**18))  # a new modification time: hashed again
    assert file_digest.digest(str(path), cache) == hashlib.sha256(b"b" * 1000).hexdigest()
    assert len(hashed) == 2
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "x").write_bytes(b"x")
    before = file_digest.digest(str(folder), cache)
    (folder / "y").write_bytes(b"y")
    assert file_digest.digest(str(folder), cache) != before


def test_a_same_size_rewrite_with_its_modification_time_kept_is_hashed_again(tmp_path):
    """A teacher replaced by another of the same size, its modification time set back (touch
    -r, cp -p): the write moved its change time, so the new bytes are hashed. Before, the cache
    (path, size, modification time) gave the old file's SHA-256 for the new bytes, and the
    resume went on silently with another teacher. A file moved over it (another inode) too."""
    path, cache = tmp_path / "teacher.safetensors", tmp_path / "cache"
    path.write_bytes(b"a" * 1000)
    os.utime(path, ns=(10**18, 10**18))
    assert file_digest.digest(str(path), cache) == hashlib.sha256(b"a" * 1000).hexdigest()
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(10**18, 10**18))  # as touch -r would set it back
    assert file_digest.digest(str(path), cache) == hashlib.sha256(b"b" * 1000).hexdigest()
    other = tmp_path / "other"
    other.write_bytes(b"c" * 1000)
    os.utime(other, ns=(10**18, 10**18))
    os.replace(other, path)
    assert file_digest.digest(str(path), cache) == hashlib.sha256(b"c" * 1000).hexdigest()
