"""Failures that were tracebacks, each now one line with its exit status (pycls.errors): a zoo
teacher's weights file that would run code (torch's advice to load it unsafely never shown), a
checkpoint whose stored config has a key this pycls does not know (``pycls export``), one of the
processes of a tensor-parallel run killed (exit 1, the launcher's traceback in the log file); a
diverged run (its own exit status, no checkpoint written)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from pycls.checkpoint import single_file, weight_files
from pycls.core import cli
from pycls.core.weight_commands import export_main
from pycls.errors import EXIT_DIVERGED
from tests.helpers import QUICKSTART, ROOT, RUN_NET, TINY, scaled, tiny_vit


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_zoo_teachers_weights_that_would_run_code_are_one_line_and_run_nothing(tmp_path, capsys):
    evil, marker = tmp_path / "teacher.pth", tmp_path / "ran"
    torch.save({"model_state": _RunsACommand(marker)}, evil)
    status = cli.main(["--mode", "train", "--cfg", QUICKSTART, *TINY, "OUT_DIR", str(tmp_path),
                       "DISTILL.TYPE", "hard", "DISTILL.TEACHER", "zoo:RegNetX-200MF",
                       "DISTILL.TEACHER_WEIGHTS", str(evil)])  # fmt: skip
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and line.startswith(f"error: DISTILL.TEACHER_WEIGHTS: cannot read {evil}")
    assert "it holds Python objects" in line and "weights_only" not in line, line
    assert not marker.exists()


def _with_stored_config(tmp_path, kind, text):
    model = tiny_vit()
    path = str(tmp_path / f"model.{kind}")
    if kind == "safetensors":
        weight_files.save_safetensors(model.state_dict(), path, {"naming": "pycls", "cfg": text})
    else:
        single_file.save_file({"epoch": 1, "model_state": model.state_dict(), "cfg": text}, path)
    return path


@pytest.mark.parametrize("kind", ["safetensors", "pyth"])
def test_export_of_a_checkpoint_with_a_key_this_version_does_not_know_is_one_line(
    tmp_path, capsys, kind
):
    text = "MODEL:\n  TYPE: vit\nVIT:\n  DEPTH: 2\n  ROPE_THETA: 100.0\n"
    path = _with_stored_config(tmp_path, kind, text)
    status = export_main([path, "--format", "safetensors", "--out", str(tmp_path / "out.st")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert status == 2, line
    assert line.startswith(f"config error: {path}: its stored config: VIT.ROPE_THETA: a key this")
    assert not (tmp_path / "out.st").exists()


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    out = []
    for kid in kids:
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            out.append(kid)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes in /proc")
def test_a_killed_tensor_parallel_process_is_one_line_exit_1_the_traceback_in_the_log(tmp_path):
    """The launcher's ProcessExitedException was a traceback on the terminal (2 processes)."""
    out = tmp_path / "run"
    cmd = [sys.executable, RUN_NET, "--mode", "train", "--cfg", QUICKSTART, *TINY, "OUT_DIR",
           str(out), "DEVICE", "cpu", "AMP.LEVEL", "O0", "DATA_LOADER.NUM_WORKERS", "0",
           "NUM_PROCS", "2", "TRAIN.PARALLEL", "tensor", "MESH.TP", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)  # fmt: skip
    log, deadline = out / "stdout.log", time.time() + scaled(300)
    try:  # the mesh is built: both processes are in the run
        while not (log.exists() and "communication per optimizer step" in log.read_text()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        victims = _children(proc.pid)
        assert len(victims) == 2
        os.kill(victims[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=scaled(300))
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[-1].startswith("error: process 1 of 2 died of SIGKILL"), stderr[-3000:]
    assert f"(details: {log})" in lines[-1]
    text = log.read_text()
    assert "Traceback" in text and "ProcessExitedException" in text


@pytest.mark.usefixtures("single_thread")
def test_a_diverged_run_stops_in_one_line_with_its_own_exit_status(tmp_path, capsys):
    args = ["--mode", "train", "--cfg", QUICKSTART, *TINY, "OUT_DIR", str(tmp_path)]
    args += ["OPTIM.OPTIMIZER", "sgd", "OPTIM.BASE_LR", "1e12", "OPTIM.WARMUP_EPOCHS", "0"]
    assert cli.main(args) == EXIT_DIVERGED == 3
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(r"error: loss is (nan|inf) at epoch 1, iteration \d+ \(AMP.LEVEL=", line)
    assert single_file.get_last_checkpoint(str(tmp_path)) is None
