"""Ctrl-C at a terminal, on real ``tools/run_net.py`` runs (one process and NUM_PROCS 2): the
first press stops at the next sync point with a checkpoint, like a preemption, and the run resumes
from it; a second press aborts at once in one line."""

import os
import signal
import subprocess
import sys
import time

import pytest

from pycls.checkpoint import single_file as checkpoint
from tests.helpers import (
    QUICKSTART,
    ROOT,
    TINY,
    json_stats_of,
    scaled,
)

pytestmark = pytest.mark.usefixtures("single_thread")


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
