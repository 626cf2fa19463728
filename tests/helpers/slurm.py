"""The local SLURM cluster of the tests marked ``slurm`` (tools/slurm/local_cluster.sh): asked for
with PYCLS_TEST_SLURM=1, started by the ``slurm`` fixture (tests/conftest.py) only then, and
stopped again by it if it started it."""

import os
import shutil
import subprocess
import sys

from tests.helpers import ROOT, scaled

CLUSTER = os.path.join(ROOT, "tools", "slurm", "local_cluster.sh")

# What a skipped slurm test says
NOT_ASKED = (
    "starts a local SLURM cluster (slurmctld, slurmd, munged) on this machine: set "
    "PYCLS_TEST_SLURM=1 to run it (`PYCLS_TEST_SLURM=1 python -m pytest -q -m slurm tests`; "
    "as root `tools/slurm/local_cluster.sh start` installs slurm-wlm and munge first)"
)


def asked():
    """Whoever runs the tests asked for the SLURM jobs (PYCLS_TEST_SLURM=1)."""
    return os.environ.get("PYCLS_TEST_SLURM", "") not in ("", "0")


def subprocess_env(**extra):
    """The environment of a command the tests start: this Python's folder first on PATH, the
    checkout on PYTHONPATH, one thread per process."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = {**os.environ, "PATH": path, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return {**env, **extra}


def cluster(*args, directory=None, **environ):
    """``local_cluster.sh ARGS`` (never installing packages), for the cluster in ``directory``
    (default /tmp/pycls-slurm)."""
    if directory is not None:
        environ["PYCLS_SLURM_DIR"] = str(directory)
    env = subprocess_env(PYCLS_SLURM_NO_INSTALL="1", **environ)
    return subprocess.run(["bash", CLUSTER, *args], capture_output=True, text=True, env=env,
                          timeout=scaled(120))  # fmt: skip


def start():
    """(environment with SLURM_CONF, whether this call started the cluster); raises RuntimeError
    with the script's last line when it cannot start."""
    if shutil.which("bash") is None:
        raise RuntimeError("the local SLURM cluster script needs bash")
    was_up = cluster("status").returncode == 0
    if not was_up:
        out = cluster("start")
        if out.returncode != 0:
            raise RuntimeError((out.stderr.strip().splitlines() or ["no output"])[-1])
    conf = cluster("env").stdout.strip().split("=", 1)[1]
    return subprocess_env(SLURM_CONF=conf), not was_up
