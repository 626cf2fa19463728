"""Several processes train one model or none: TRAIN.PARALLEL none with NUM_PROCS > 1 or a
launcher's several processes is refused for training and the LR range test (each process would
train its own copy, unsynchronised, and log an accuracy no checkpoint reproduces), in one line
naming the key, before any process starts; evaluating with several processes stays allowed."""

import pytest

from pycls.core import cli
from tests.helpers import QUICKSTART, TINY


@pytest.mark.parametrize("mode", ["train", "lrfind"])
def test_several_processes_without_an_engine_are_refused(capsys, tmp_path, mode):
    opts = [*TINY, "NUM_PROCS", "2", "OUT_DIR", str(tmp_path)]
    assert cli.main(["--mode", mode, "--cfg", QUICKSTART, *opts]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: TRAIN.PARALLEL: none with 2 proc")
    assert not list(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_a_launchers_processes_without_an_engine_are_refused(
    capsys, monkeypatch, tmp_path, launcher
):
    if launcher == "torchrun":
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = "29500"
    else:
        env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}
        env.update(
            SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="1", SLURM_STEP_NODELIST="localhost"
        )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    opts = [*TINY, "OUT_DIR", str(tmp_path)]
    assert cli.main(["--mode", "train", "--cfg", QUICKSTART, *opts]) == 2
    assert "TRAIN.PARALLEL: none with 2 processes" in capsys.readouterr().err
