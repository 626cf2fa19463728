"""One run per OUT_DIR (pycls.checkpoint.run_lock): a second run is refused naming the holder
before it writes anything, a dead holder's lock is taken over with a warning, another host's never;
a full disk while the lock is written leaves no lock behind."""

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from pycls.checkpoint import run_lock
from pycls.checkpoint.run_lock import RunLock, RunLockedError
from pycls.core import trainer
from tests.helpers import (
    tiny_quickstart,
)

pytestmark = pytest.mark.usefixtures("single_thread")


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


def test_lock_of_another_host_is_never_taken_over(tmp_path):
    info = {"host": "elsewhere", "pid": 1, "start_time": time.time()}
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(info))
    with pytest.raises(RunLockedError, match="host elsewhere, pid 1"):
        RunLock(str(tmp_path)).acquire()
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text()) == info
