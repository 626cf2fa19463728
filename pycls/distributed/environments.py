"""Where a run's processes come from, as their launcher describes them (torchrun's or srun's
variables; none for a plain process), and how many CPU threads each should use. Reads the
environment only: no torch, no process group."""

import os
import re
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessEnv:
    """One process's place in a run, as a launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "spawn"


def torchrun_env(environ=None):
    """The ProcessEnv torchrun (or any launcher exporting its variables) set up, else None."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    return ProcessEnv(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", 29500)),
        launcher="torchrun",
    )


def slurm_env(environ=None):
    """The ProcessEnv of a task that srun started (one task per process), else None.

    Only job steps count (SLURM_STEP_ID is set by srun, not in the batch script itself), and only
    with more than one task. The master port is MASTER_PORT if exported, else derived from the job
    id so that every task computes the same one without talking to the others.
    """
    env = os.environ if environ is None else environ
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    ntasks = env.get("SLURM_NTASKS", env.get("SLURM_NPROCS"))
    if step is None or ntasks is None or "SLURM_PROCID" not in env or int(ntasks) <= 1:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    nodelist = nodelist or env.get("SLURM_NODELIST", "")
    return ProcessEnv(
        rank=int(env["SLURM_PROCID"]),
        world_size=int(ntasks),
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        master_port=int(env.get("MASTER_PORT") or 15000 + int(env.get("SLURM_JOB_ID", 0)) % 20000),
        launcher="slurm",
    )


def launcher_env(environ=None):
    """The ProcessEnv of an external launcher (torchrun first, then srun), or None."""
    return torchrun_env(environ) or slurm_env(environ)


def restarts_share_agent_store(environ=None):
    """Whether torchrun may restart this run's workers over a store shared with its agents.

    With a c10d rendezvous, torch lets the workers use the agents' TCPStore
    (TORCHELASTIC_USE_AGENT_STORE) and keeps that one store across restarts, the keys of the
    previous attempt included: a restarted worker can read the address of a dead one and fail to
    connect (gloo: "Connection refused"; pytorch/pytorch#135712).
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on torchrun gives every attempt a store of its own.
    """
    env = os.environ if environ is None else environ
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and restarts.isdigit()
        and int(restarts) > 0
    )


def agent_store_advice(environ=None):
    """What to change so that restarted workers cannot read a dead one's address from a store
    shared with torchrun's agents (``restarts_share_agent_store``), or None when nothing needs
    to. torch's c10d rendezvous stops sharing its store under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1;
    its static rendezvous (torchrun's default, without --rdzv-backend) ignores the variable."""
    env = os.environ if environ is None else environ
    if not restarts_share_agent_store(env):
        return None
    if env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":  # set, so the rendezvous is static
        return (
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set, but torchrun's static rendezvous (its "
            "default) shares its store whatever it says: start torchrun with --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT, which honours it"
        )
    return (
        "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun, with a c10d rendezvous "
        "(--rdzv-backend c10d; the static default ignores the variable)"
    )


def node_layout(environ=None):
    """``(machines, processes per machine)`` of this run as its launcher describes it, or None
    where it does not say, the machines hold different numbers of processes, or a machine's
    ranks are not consecutive (srun's cyclic distribution): the shape HSDP's default replicas
    follow (``mesh_layout.node_replicas``). torchrun: WORLD_SIZE over LOCAL_WORLD_SIZE, its
    ranks numbered machine by machine (GROUP_RANK, where set, must agree); srun: the step's
    tasks per node (``2(x4)``), this task's SLURM_NODEID agreeing with its rank."""
    env = os.environ if environ is None else environ
    run = torchrun_env(env)
    if run is not None:  # torchrun's variables win over SLURM's, as for the ranks
        if "LOCAL_WORLD_SIZE" not in env:
            return None
        per_node = int(env["LOCAL_WORLD_SIZE"])
        node = int(env.get("GROUP_RANK", run.rank // max(per_node, 1)))
        return _uniform(run.world_size, per_node, node, run.rank)
    run = slurm_env(env)
    if run is None:
        return None
    counts = _slurm_tasks_per_node(env)
    if not counts or len(set(counts)) != 1 or len(counts) * counts[0] != run.world_size:
        return None
    node = int(env.get("SLURM_NODEID", -1))
    return _uniform(run.world_size, counts[0], node, run.rank)


def _uniform(world, per_node, node, rank):
    """``(world // per_node, per_node)`` where ``rank`` sits on machine ``node`` as consecutive
    numbering puts it, else None."""
    if per_node <= 0 or world % per_node or rank // per_node != node:
        return None
    return world // per_node, per_node


def first_slurm_host(nodelist):
    """The first host of a SLURM node list: ``scontrol show hostnames`` if available, else parsed.

    The parser handles the usual compressed forms: ``node07``, ``gpu[003-010,012]``,
    ``rack[1-2]-n[01-04],login1`` (the first of each bracket, zero padding kept).
    """
    if not nodelist:
        return "127.0.0.1"
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_first_host(nodelist)


def parse_first_host(nodelist):
    """First host of a compressed SLURM node list, without scontrol."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first host pattern
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    pattern = nodelist[:end]
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], pattern)


# ------------------------------------------------------------------------------------------------ #
# CPU threads: the cores a process was given, shared with the processes beside it
# ------------------------------------------------------------------------------------------------ #


def _slurm_tasks_per_node(env):
    """Tasks of this SLURM step (or job) on each of its nodes, from e.g. ``2(x3),1``; None
    without a readable spec."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _tasks_on_this_node(env):
    """Tasks of this SLURM step (or job) on this node (SLURM_NODEID)."""
    counts = _slurm_tasks_per_node(env)
    if not counts:
        return None
    node = int(env.get("SLURM_NODEID", 0))
    return counts[node] if 0 <= node < len(counts) else counts[0]


def local_world_size(environ=None):
    """Processes of this run on this machine, as the launcher says (1 if it says nothing)."""
    env = os.environ if environ is None else environ
    if "LOCAL_WORLD_SIZE" in env:  # torchrun (and submitit's exported environment)
        return int(env["LOCAL_WORLD_SIZE"])
    if slurm_env(env) is not None:
        return _tasks_on_this_node(env) or 1
    return 1


def available_cpus():
    """CPUs this process may run on: its affinity mask (what taskset / cgroups / SLURM allow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_threads(configured=0, environ=None, nprocs=None):
    """Intra-op threads for this process, or None to leave torch's default.

    ``configured`` (the CPU_THREADS key) wins, then OMP_NUM_THREADS (torch reads it itself). Else
    a SLURM task uses its SLURM_CPUS_PER_TASK, and a process launched beside others (torchrun,
    srun, ``NUM_PROCS``: ``nprocs``) takes its affinity mask divided by the processes on this
    machine: without this each would start one thread per core, and two processes on two cores
    thrash (30x slower epochs). A plain single process keeps torch's default.
    """
    env = os.environ if environ is None else environ
    if configured > 0:
        return configured
    if env.get("OMP_NUM_THREADS"):
        return None
    if env.get("SLURM_CPUS_PER_TASK") and "SLURM_JOB_ID" in env:
        return max(1, int(env["SLURM_CPUS_PER_TASK"]))
    sharing = nprocs or local_world_size(env)
    if sharing <= 1 and launcher_env(env) is None:
        return None
    return max(1, available_cpus() // max(1, sharing))
