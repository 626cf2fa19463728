"""Launchers for real: a one-node SLURM cluster (tools/slurm/local_cluster.sh), torchrun with two
agents as two nodes, CPU threads per process, and loader workers under a stop signal.

The tests marked ``slurm`` submit real jobs; they skip, with the reason, when the local cluster
cannot start (start it with ``tools/slurm/local_cluster.sh start``, as root the first time: it
installs slurm-wlm and munge). A requeued job starts again about 11 s later (the cluster's job
credentials live 10 s).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset

from pycls import distributed
from pycls.checkpoint import single_file as checkpoint
from pycls.datasets import AugmentedDataset, construct_loader
from pycls.datasets.loading.dead_workers import WORKER_DIED
from pycls.datasets.loading.loader import loader_batches
from pycls.distributed import environments
from tests.helpers import QUICKSTART, ROOT, RUN_NET, TINY, free_port, json_stats_of, scaled
from tests.helpers.slurm import cluster, subprocess_env

TEMPLATE = os.path.join(ROOT, "tools", "slurm", "train.sbatch")
QUICKSTART_SWEEP = os.path.join(ROOT, "configs", "sweeps", "quickstart_lr.yaml")


# ------------------------------------------------------------------------------------------------ #
# CPU threads per process
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize(
    "environ, configured, nprocs, threads",
    [
        ({}, 0, None, None),  # a plain process keeps torch's default
        ({}, 3, None, 3),  # CPU_THREADS wins over everything
        ({"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "2"}, 0, None, None),  # torch reads it
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 0, None, 4),  # torchrun
        ({}, 0, 4, 2),  # NUM_PROCS 4
        # srun -n 2 on one node, no --cpus-per-task: the affinity mask shared by two tasks
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
                "SLURM_STEP_TASKS_PER_NODE": "2",
            },
            0,
            None,
            4,
        ),  # fmt: skip
        # 2 nodes x 4 tasks, this is node 1
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
                "SLURM_NODEID": "1",
            },
            0,
            None,
            2,
        ),  # fmt: skip
        # srun --cpus-per-task 3: what SLURM gave the task
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_CPUS_PER_TASK": "3",
            },
            0,
            None,
            3,
        ),  # fmt: skip
    ],
)
def test_cpu_threads_under_every_launcher(monkeypatch, environ, configured, nprocs, threads):
    monkeypatch.setattr(environments, "available_cpus", lambda: 8)
    assert distributed.cpu_threads(configured, environ, nprocs) == threads


# ------------------------------------------------------------------------------------------------ #
# Loader workers and stop signals
# ------------------------------------------------------------------------------------------------ #


class _SelfSignalling(Dataset):
    """Tiny images; in a loader worker, sample ``index`` sends ``signum`` to its own process."""

    def __init__(self, index, signum):
        self.index, self.signum = index, signum

    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i == self.index and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), self.signum)
            time.sleep(0.2)  # a signal that kills lands before the sample is returned
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i % 3


def _loader(base, workers):
    dataset = AugmentedDataset(base, lambda size, train: lambda image: image, train=True)
    return construct_loader(
        dataset, batch_size=4, shuffle=True, drop_last=False, num_workers=workers,
        pin_memory=False, persistent_workers=False, prefetch_factor=2, seed=0, image_size=4,
    )  # fmt: skip


def _assert_same_batches(got, want):
    assert len(got) == len(want) == 6
    for (a, b, _), (c, d, _) in zip(got, want):
        assert torch.equal(a, c) and torch.equal(b, d)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_loader_workers_ignore_stop_signals(signum):
    """SLURM signals every process of a step: the workers carry on (torch's die of SIGTERM)."""
    want = list(_loader(_SelfSignalling(9, signum), 0))
    _assert_same_batches(list(_loader(_SelfSignalling(9, signum), 2)), want)


def test_worker_dying_while_stopping_keeps_the_batches():
    """A worker killed outright while a stop is pending: the epoch's remaining batches come from
    the main process, the same ones, so the run still reaches its checkpoint."""
    base = _SelfSignalling(9, signal.SIGKILL)
    want = list(_loader(base, 0))
    with pytest.raises(WORKER_DIED):  # not stopping: torch's error
        list(loader_batches(_loader(base, 2)))
    flag = distributed.PreemptionFlag().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert distributed.stop_pending()
        got = list(loader_batches(_loader(base, 2)))
    finally:
        flag.uninstall()
    assert not distributed.stop_pending()
    _assert_same_batches(got, want)


def test_error_with_live_loader_workers_exits_promptly():
    """An error raised while a loader iterator is alive (its frame kept by the traceback): at exit
    multiprocessing sends its daemonic children SIGTERM and waits for them, but the workers
    ignore SIGTERM, so the process hung until killed; under torchrun that cost every restart the
    agent's 30 s shutdown timeout (a worker whose peer died fails in a collective)."""
    code = (
        "import importlib, sys, time; sys.path.insert(0, sys.argv[1]); "
        "t = importlib.import_module(sys.argv[2]); "
        "batches = iter(t._loader(t._SelfSignalling(-1, 0), 2)); next(batches); "
        "print(time.time(), flush=True); raise RuntimeError('a peer died')"
    )
    out = subprocess.run([sys.executable, "-c", code, ROOT, __name__], capture_output=True,
                         text=True, env=subprocess_env(), timeout=scaled(60))  # fmt: skip
    assert out.returncode == 1 and "a peer died" in out.stderr, out.stderr[-2000:]
    assert time.time() - float(out.stdout) < scaled(10)  # the error to the exit (hung: 30 s+)


# ------------------------------------------------------------------------------------------------ #
# Multi-node rendezvous simulated on one machine: two torchrun agents, one process each
# ------------------------------------------------------------------------------------------------ #

# 1 epoch of the tiny quickstart, batch 16 (~90 steps), two loader workers
SHORT = [*TINY, "TRAIN.BATCH_SIZE", "16", "OPTIM.MAX_EPOCH", "1", "DEVICE", "cpu"]
SHORT += ["DATA_LOADER.NUM_WORKERS", "2"]


def _train(out_dir, *overrides, timeout=300):
    cmd = [sys.executable, RUN_NET, "--mode", "train", "--cfg", QUICKSTART, *SHORT, *overrides]
    out = subprocess.run([*cmd, "OUT_DIR", str(out_dir)], capture_output=True, text=True,
                         env=subprocess_env(), cwd=ROOT, timeout=scaled(timeout))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out_dir


def _weights(out_dir, epoch=1):
    return checkpoint.load_file(checkpoint.get_checkpoint_path(str(out_dir), epoch))["model_state"]


def _assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted DDP run (a process group of one) the stopped runs must reproduce."""
    return _train(tmp_path_factory.mktemp("reference"), "TRAIN.PARALLEL", "ddp")


@pytest.mark.parametrize(
    "environ, hazard",
    [
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}, True),
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the agents tell their workers not to share
        ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"}, False),
        ({}, False),
    ],
)
def test_restarts_over_a_shared_agent_store_are_flagged(environ, hazard):
    assert distributed.restarts_share_agent_store(environ) is hazard


def test_sbatch_template_launches_with_srun_and_requeues_on_75():
    """The template leads SLURM users to srun (whose status is the tasks' own); torchrun's would
    be 1 after a clean stop (the next test)."""
    with open(TEMPLATE) as f:
        commands = [line for line in f if line.strip() and not line.lstrip().startswith("#")]
    launch = [line for line in commands if "tools/run_net.py" in line]
    assert len(launch) == 1 and launch[0].startswith("srun python tools/run_net.py")
    assert not any("torchrun" in line or "torch.distributed.run" in line for line in commands)
    assert 'if [ "$status" -eq 75 ]; then' in "".join(commands)


def test_torchrun_stop_checkpoints_but_the_agent_exits_with_its_own_status(tmp_path):
    """What docs/distributed.md tells torchrun users: SIGTERM to the agent, the worker writes its
    mid-epoch checkpoint and says so, and the agent exits 1 after a SignalException (~20 s)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(free_port()), RUN_NET, "--mode", "train", "--cfg", QUICKSTART,
           *TINY, "OPTIM.MAX_EPOCH", "5", "DEVICE", "cpu", "OUT_DIR", str(tmp_path)]  # fmt: skip
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=subprocess_env(), cwd=ROOT)  # fmt: skip
    for line in agent.stdout:
        if '"train_iter"' in line:
            agent.send_signal(signal.SIGTERM)
            break
    rest = agent.stdout.read()
    assert agent.wait(timeout=scaled(120)) == 1, rest[-3000:]
    assert "stopping on a preemption signal after epoch 0 + " in rest
    assert "SignalException" in rest.strip().splitlines()[-1]
    assert "_iter_" in checkpoint.get_last_checkpoint(str(tmp_path))
    with open(os.path.join(ROOT, "docs", "distributed.md")) as f:
        page = " ".join(f.read().split())
    assert "the agent itself exits with status **1** after a `SignalException` traceback" in page


def _two_node_torchrun(out_dir, *overrides, max_restarts=0):
    """Two torchrun agents (``--nnodes 2``), as two nodes would start them; returns both.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the docs ask for restarts: otherwise the workers
    share one store with the agents across restarts, and a restarted worker can read the address
    a dead worker of the previous attempt left there (pytorch/pytorch#135712): gloo then fails to
    connect ("Connection refused"), in 2 of 3 runs on a loaded machine."""
    port = free_port()
    agents = []
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_id", "pycls-test",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--max-restarts", str(max_restarts),
               RUN_NET, "--mode", "train", "--cfg", QUICKSTART, *SHORT,
               "TRAIN.PARALLEL", "ddp", "OUT_DIR", str(out_dir), *overrides]  # fmt: skip
        env = subprocess_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=env, cwd=ROOT))  # fmt: skip
    return agents


def _finish(agents, timeout=300):
    """Waits for the agents; on timeout kills their workers, then them (workers whose agent was
    killed would wait for their peers for gloo's 30 minutes)."""
    deadline = time.time() + scaled(timeout)
    try:
        outs = [a.communicate(timeout=max(1, deadline - time.time()))[0] for a in agents]
    except subprocess.TimeoutExpired:
        for a in agents:
            for pid in _worker_pids(a.pid):
                os.kill(pid, signal.SIGKILL)
            a.kill()
        outs = [a.communicate()[0] for a in agents]
        message = f"torchrun did not finish in {timeout} s:\n{outs[0][-3000:]}"
        raise AssertionError(message) from None
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-3000:]
    return outs


def _worker_pids(agent_pid):
    """Pids of the training processes torchrun started (its children running run_net.py)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent_pid and "run_net.py" in cmdline:
            pids.append(int(entry))
    return pids


# Two epochs with a checkpoint after each: a worker killed in the second restarts from the first
TWO_EPOCHS = ["OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_PERIOD", "1"]


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    """An uninterrupted ``torchrun --nnodes 2`` run of TWO_EPOCHS (c10d rendezvous, two agents,
    one process each)."""
    out_dir = tmp_path_factory.mktemp("two_node")
    _finish(_two_node_torchrun(out_dir, *TWO_EPOCHS))
    return out_dir


@pytest.mark.slow
@pytest.mark.exhaustive
def test_two_node_torchrun_matches_one_process(two_node_run, tmp_path):
    """``torchrun --nnodes 2`` with a c10d rendezvous: two agents, one process each (~25 s with
    the fixture); each epoch matches one process."""
    one = _train(tmp_path / "one", *TWO_EPOCHS)
    got = json_stats_of(two_node_run, "train_epoch")
    want = json_stats_of(one, "train_epoch")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g["num_samples"] == w["num_samples"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4)
        assert g["top1_err"] == pytest.approx(w["top1_err"], abs=0.5)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker's process in /proc")
def test_two_node_torchrun_restarts_after_a_worker_dies(two_node_run, tmp_path):
    """``--max-restarts 1``: a worker killed mid-epoch makes both agents restart their workers,
    which resume from the last checkpoint and end with the weights of the uninterrupted run
    (35-50 s, plus the shared uninterrupted run)."""
    restarted = tmp_path / "restarted"
    agents = _two_node_torchrun(restarted, *TWO_EPOCHS, max_restarts=1)
    first = checkpoint.get_checkpoint_path(str(restarted), 1)
    deadline = time.time() + scaled(240)
    while not os.path.exists(first):
        assert time.time() < deadline and all(a.poll() is None for a in agents), "no checkpoint"
        time.sleep(0.05)
    time.sleep(0.5)  # into the second epoch
    (victim,) = _worker_pids(agents[1].pid)
    os.kill(victim, signal.SIGKILL)
    outs = _finish(agents)
    assert f"(pid: {victim})" in outs[1], outs[1][-3000:]  # its agent saw it fail
    with open(restarted / "stdout.log") as f:
        log = f.read()
    assert log.count("2 process(es)") == 2, log[-3000:]  # started twice
    assert f"resumed from {first}" in log
    _assert_bitwise_equal(_weights(restarted, 2), _weights(two_node_run, 2))


# ------------------------------------------------------------------------------------------------ #
# A real one-node SLURM cluster
# ------------------------------------------------------------------------------------------------ #


def _answering_config(directory):
    """(ClusterName, SLURM_CONF) that the controller reached through directory's slurm.conf
    reports: the file it was started from."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                         env=subprocess_env(SLURM_CONF=str(directory / "slurm.conf")))  # fmt: skip
    found = dict(re.findall(r"^(ClusterName|SLURM_CONF)\s*=\s*(\S+)", out.stdout, re.M))
    return found.get("ClusterName"), found.get("SLURM_CONF")


def test_cluster_script_never_takes_another_controller_for_its_own(tmp_path):
    """Another SLURM answering at this cluster's address (here: fake clients that report another
    cluster's name and config) is reported, and the cluster counts as down."""
    bin_dir, ours = tmp_path / "bin", tmp_path / "ours"
    bin_dir.mkdir()
    ours.mkdir()
    (ours / "slurm.conf").write_text("ClusterName=whatever\n")
    (bin_dir / "sinfo").write_text("#!/bin/sh\necho idle\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\necho 'ClusterName             = site'\n"
        "echo 'SLURM_CONF              = /etc/slurm/slurm.conf'\n"
    )
    for tool in ("sinfo", "scontrol"):
        os.chmod(bin_dir / tool, 0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    out = cluster("status", directory=ours, PATH=path)
    assert (out.returncode, out.stdout.strip()) == (1, "down"), out
    assert "another SLURM controller" in out.stderr and "site /etc/slurm/slurm.conf" in out.stderr


@pytest.mark.slurm
def test_cluster_has_ports_of_its_own_beside_a_cluster_on_the_default_ports(tmp_path):
    """A second cluster (another config, SLURM's default ports 6817/6818, as a machine's own
    SLURM would be) runs: ours starts beside it on other ports and answers as itself (~5 s)."""
    other, ours = tmp_path / "other", tmp_path / "ours"
    started = cluster(
        "start", directory=other, PYCLS_SLURMCTLD_PORT="6817", PYCLS_SLURMD_PORT="6818"
    )
    try:
        if started.returncode != 0:
            reason = (started.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"no second cluster on SLURM's default ports: {reason}")
        assert _answering_config(other) == (_answering_config(other)[0], str(other / "slurm.conf"))
        out = cluster("start", directory=ours)
        assert out.returncode == 0, out.stderr
        conf = (ours / "slurm.conf").read_text()
        ports = re.findall(r"^Slurm(?:ctld|d)Port=(\d+)$", conf, re.M)
        assert len(ports) == 2 and not {"6817", "6818"} & set(ports), conf
        name, path = _answering_config(ours)
        assert path == str(ours / "slurm.conf") and name != _answering_config(other)[0]
        assert cluster("status", directory=ours).returncode == 0
    finally:
        cluster("stop", directory=ours)
        cluster("stop", directory=other)


def _job_info(env, job):
    """``scontrol show job`` as a dict, or None once the job is gone."""
    out = subprocess.run(["scontrol", "-o", "show", "job", str(job)], capture_output=True,
                         text=True, env=env)  # fmt: skip
    if out.returncode != 0 or not out.stdout.strip():
        return None
    # one job (an array shows one line per task); the values of interest have no spaces
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout.splitlines()[0]))


def _wait_job(env, job, timeout=240):
    """Waits until the job ends (requeues included); returns its final info."""
    deadline = time.time() + scaled(timeout)
    while time.time() < deadline:
        info = _job_info(env, job)
        if info is None or info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            return info
        time.sleep(0.3)
    subprocess.run(["scancel", str(job)], env=env)
    raise AssertionError(f"job {job} did not end within {timeout} s: {_job_info(env, job)}")


def _wait_for(path, text, timeout=120):
    deadline = time.time() + scaled(timeout)
    while time.time() < deadline:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                if text in f.read():
                    return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


def _sbatch(env, out_dir, options=(), overrides=()):
    """Submits the repository's sbatch template (one task, no GPU) training SHORT + overrides
    into out_dir; returns the job id."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = ["sbatch", "--parsable", "--ntasks-per-node=1", "--gpus-per-node=0",
           "--cpus-per-task=1", f"--output={out_dir}/slurm-%j.out", *options, TEMPLATE,
           *SHORT, *overrides, "OUT_DIR", str(out_dir)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYCLS_CFG": QUICKSTART},
                         cwd=ROOT, check=True)  # fmt: skip
    return out.stdout.strip().split(";")[0]


def _slurm_output(out_dir, job):
    with open(os.path.join(out_dir, f"slurm-{job}.out"), errors="replace") as f:
        return f.read()


@pytest.mark.slurm
def test_srun_ddp_matches_one_process_with_a_thread_per_core(slurm, tmp_path):
    """``srun -n 2`` makes a DDP run of two tasks (SLURM_PROCID, SLURM_NTASKS, the node list);
    its first epoch matches one process. OMP_NUM_THREADS is unset, as under a plain srun: each
    task must take one of the two cores, not both (~25 s)."""
    env = {k: v for k, v in slurm.items() if k != "OMP_NUM_THREADS"}
    one = _train(tmp_path / "one", "TRAIN.PARALLEL", "ddp")
    cmd = [
        "srun",
        "-N1",
        "-n2",
        "--time=5",
        sys.executable,
        RUN_NET,
        "--mode",
        "train",
        "--cfg",
        QUICKSTART,
        *SHORT,
        "TRAIN.PARALLEL",
        "ddp",
        "OUT_DIR",
        str(tmp_path / "srun"),
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=scaled(300)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "srun" / "stdout.log") as f:
        log = f.read()
    assert "2 process(es)" in log
    cpus = len(os.sched_getaffinity(0))
    assert f"{max(1, cpus // 2)} CPU thread(s) each" in log
    got = json_stats_of(tmp_path / "srun", "train_epoch")[-1]
    want = json_stats_of(one, "train_epoch")[-1]
    assert got["num_samples"] == want["num_samples"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)


@pytest.mark.slurm
@pytest.mark.parametrize("signame", ["USR1", "TERM"])
def test_sbatch_job_preempted_checkpoints_requeues_and_resumes(slurm, reference, tmp_path, signame):
    """The sbatch template with two loader workers per task. ``scancel --signal`` reaches every
    process of the step, workers included: the task checkpoints mid-epoch, exits 75, the script
    requeues the job, and the resumed run ends bitwise equal to an uninterrupted one (~20 s)."""
    out_dir = tmp_path / "run"
    job = _sbatch(slurm, out_dir)
    _wait_for(out_dir / f"slurm-{job}.out", '"train_iter"')
    subprocess.run(["scancel", f"--signal={signame}", job], env=slurm, check=True)
    info = _wait_job(slurm, job)
    text = _slurm_output(out_dir, job)
    assert info is not None and info["JobState"] == "COMPLETED", text[-3000:]
    assert int(info["Restarts"]) == 1
    stop = re.search(r"stopping on a preemption signal after epoch 0 \+ (\d+) steps", text)
    assert stop and int(stop.group(1)) > 0, text[-3000:]  # mid-epoch
    mid_epoch = checkpoint.get_checkpoint_path(str(out_dir), 0, int(stop.group(1)))
    assert f"resumed from {mid_epoch}" in text
    assert "killed by signal" not in text
    _assert_bitwise_equal(_weights(out_dir), _weights(reference))


def _training_process(out_dir):
    """Pid of the job's training process (not one of its loader workers): the process whose
    command line names out_dir and whose parent's does not."""

    def cmdline(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")

    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            mine = "run_net.py" in cmdline(entry) and str(out_dir) in cmdline(entry)
            if mine and str(out_dir) not in cmdline(ppid):
                return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no training process for {out_dir}")


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the training process in /proc")
def test_time_limit_signal_checkpoints_requeues_and_finishes(slurm, reference, tmp_path):
    """``--time=1 --signal=USR1@5``: SLURM's controller checks time limits every 30 s and warns
    at the first check within N + 30 s of the limit, so 25-55 s into each attempt, and ends an
    attempt at the first check past it (30 s or more after the warning). The first attempt is
    paused (SIGSTOP) mid-epoch, as if its training were longer than the limit; SLURM's warning
    sends SIGCONT, then USR1: the attempt writes its mid-epoch checkpoint and exits 75, and the
    job script requeues it. The job's limit is then raised to 10 minutes (as an administrator
    would for a job that needs longer), so that the pass does not depend on how fast this
    machine runs the second attempt (on a busy one it once finished just as its own one-minute
    limit ended it: TIMEOUT); it resumes and finishes, bitwise equal to an uninterrupted run
    (55-80 s on an idle machine, mostly waiting)."""
    out_dir = tmp_path / "run"
    job = _sbatch(slurm, out_dir, ["--time=1", "--signal=USR1@5"])
    log = out_dir / f"slurm-{job}.out"
    _wait_for(log, '"train_iter"')
    os.kill(_training_process(out_dir), signal.SIGSTOP)
    _wait_for(log, "stopping on a preemption signal", timeout=120)  # the warning came
    raised = subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"],
                            capture_output=True, text=True, env=slurm)  # fmt: skip
    if raised.returncode != 0:
        subprocess.run(["scancel", str(job)], env=slurm)
        pytest.skip(
            f"raising a job's time limit needs the cluster's administrator: {raised.stderr}"
        )
    info = _wait_job(slurm, job, timeout=180)
    text = _slurm_output(out_dir, job)
    assert info is not None and info["JobState"] == "COMPLETED", text[-3000:]
    assert int(info["Restarts"]) == 1, text[-3000:]
    stop = re.search(r"stopping on a preemption signal after epoch 0 \+ (\d+) steps", text)
    assert stop and int(stop.group(1)) > 0, text[-3000:]  # mid-epoch
    mid_epoch = checkpoint.get_checkpoint_path(str(out_dir), 0, int(stop.group(1)))
    assert f"resumed from {mid_epoch}" in text
    assert "DUE TO TIME LIMIT" not in text and "User defined signal" not in text
    _assert_bitwise_equal(_weights(out_dir), _weights(reference))


def _sweep_opts(root, *extra):
    opts = ["ROOT_DIR", str(root), "LAUNCH.MODE", "slurm", "LAUNCH.WAIT", "True"]
    opts += ["LAUNCH.CPUS_PER_TASK", "1", "LAUNCH.MAX_PARALLEL", "2", "LAUNCH.TIME_LIMIT_MIN", "10"]
    for key, value in zip(TINY[::2], TINY[1::2]):
        opts += [f"SETUP.OVERRIDES.{key}", value]
    return [*opts, *extra]


@pytest.mark.slurm
def test_sweep_runs_as_a_job_array_and_is_collected(slurm, tmp_path, monkeypatch, capsys):
    """The quickstart sweep (2 points, 2 tiny epochs) as a real job array through submitit, then
    collected and analysed (~40 s)."""
    from pycls.sweep import analyze, collect, setup
    from pycls.sweep import submit as launch

    for key in ("SLURM_CONF", "PATH", "PYTHONPATH"):
        monkeypatch.setenv(key, slurm[key])
    epochs = ["SETUP.OVERRIDES.OPTIM.MAX_EPOCH", "2", "SETUP.OVERRIDES.TRAIN.EVAL_PERIOD", "1"]
    argv = ["--sweep-cfg", QUICKSTART_SWEEP, *_sweep_opts(tmp_path, *epochs)]
    assert setup.main(argv) == 0
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "done   0000" in out and "done   0001" in out, out
    assert re.search(r"queued 0000 as SLURM job \d+_0", out)
    assert collect.main(argv) == 0 and analyze.main(argv) == 0
    root = tmp_path / "quickstart_lr"
    runs = json.loads((root / "sweep.json").read_text())
    assert [r["status"] for r in runs] == ["done", "done"]
    assert [r["swept"] for r in runs] == [{"OPTIM.BASE_LR": 1e-3}, {"OPTIM.BASE_LR": 4e-3}]
    assert (root / "analysis" / "summary.md").exists()


@pytest.mark.slurm
def test_preempted_sweep_job_is_requeued_by_submitit_and_resumes(slurm, tmp_path, monkeypatch):
    """A sweep job preempted as SLURM does it (SIGTERM, then submitit's USR2, via submitit's own
    ``_interrupt``) is checkpointed and requeued by submitit and resumes from its last
    checkpoint (~40 s)."""
    import submitit

    from pycls.sweep import setup
    from pycls.sweep import submit as launch
    from pycls.sweep.runs import list_runs
    from pycls.sweep.sweep_file import load_sweep_cfg

    for key in ("SLURM_CONF", "PATH", "PYTHONPATH"):
        monkeypatch.setenv(key, slurm[key])
    opts = _sweep_opts(tmp_path, "LAUNCH.WAIT", "False")
    for key, value in (("MAX_EPOCH", "3"), ("EVAL_PERIOD", "3"), ("CHECKPOINT_PERIOD", "1")):
        section = "OPTIM" if key == "MAX_EPOCH" else "TRAIN"
        opts += [f"SETUP.OVERRIDES.{section}.{key}", value]
    sc = load_sweep_cfg(QUICKSTART_SWEEP, opts)
    setup.setup_sweep(sc)
    run, other = list_runs(sc)  # the first of the two points is preempted
    assert launch.launch_sweep(sc)["launched"] == [run.name, other.name]
    records = json.loads((tmp_path / "quickstart_lr" / "launch" / "jobs.json").read_text())
    job_id = records[run.name]["job_id"]
    deadline = time.time() + scaled(180)
    while not os.path.exists(checkpoint.get_checkpoint_path(run.out_dir, 1)):
        assert time.time() < deadline, "no first checkpoint"
        time.sleep(0.1)
    folder = tmp_path / "quickstart_lr" / "launch" / "submitit"
    submitit.SlurmJob(folder=str(folder), job_id=job_id)._interrupt()  # submitit's own test hook
    info = _wait_job(slurm, job_id, timeout=300)
    with open(run.log_file) as f:
        text = f.read()
    assert info is not None and int(info["Restarts"]) >= 1, info
    assert "resumed from" in text, text[-3000:]
    assert launch.is_finished(run)
    assert _wait_job(slurm, records[other.name]["job_id"]) is None or launch.is_finished(other)
