"""Process groups, launchers and stop signals: where a run's processes come from, who am I,
reductions of meters, and preemption (``launch`` and ``preflight`` beside this module).

Three launchers end in the same ``init_process_group`` call (``init_process_group`` below):

- torchrun (``torchrun --nnodes N --nproc_per_node G tools/run_net.py ...``) exports RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
- SLURM's srun starts one task per process and exports SLURM_PROCID, SLURM_NTASKS and
  SLURM_LOCALID; the master is the first host of the step's node list;
- ``NUM_PROCS G`` makes pycls.distributed.launch spawn G local processes itself.

The rest of pycls only asks ``get_rank()`` / ``get_world_size()`` / ``is_main_proc()``.
"""

import gc
import logging
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pycls import signals
from pycls.errors import ConfigError

# Exit status of a run stopped by SIGTERM / SIGUSR1 after writing a checkpoint: EX_TEMPFAIL from
# sysexits.h ("try again later"), so a job script can requeue on it and auto-resume picks it up
PREEMPTED_EXIT_CODE = 75
# Exit status of a run stopped by Ctrl-C (SIGINT) after writing a checkpoint: a shell's status for
# Ctrl-C (128 + 2), so that a job script does not take the user's stop for a preemption
INTERRUPTED_EXIT_CODE = 130


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_initialized() else 1


def is_main_proc():
    """Only the main process writes logs, plots and (unsharded) checkpoints."""
    return get_rank() == 0


def all_reduce_sum(tensors):
    """Sums a list of tensors across processes in place (one call per tensor, no-op alone)."""
    if get_world_size() == 1:
        return tensors
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return tensors


def all_reduce_max(tensor, group=None):
    """The elementwise maximum over the processes of ``group`` (in place; no-op alone)."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def barrier():
    if get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src=0):
    """Sends a picklable object from rank src to every rank."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def resolve_device(name):
    """Maps DEVICE ("auto", "cpu", "cuda") to a torch.device for this process."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("DEVICE: 'cuda' was asked for but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------------ #
# Where the processes come from
# ------------------------------------------------------------------------------------------------ #


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


def _tasks_on_this_node(env):
    """Tasks of this SLURM step (or job) on this node, from e.g. ``2(x3),1`` and SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
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


def set_cpu_threads(configured=0, nprocs=None):
    """Applies ``cpu_threads`` to torch; returns the threads this process now uses."""
    threads = cpu_threads(configured, nprocs=nprocs)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def wants_cuda(device_name):
    return device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())


# How many process groups this process has joined: their gloo / NCCL threads can outlive them
_groups_joined = 0


def groups_joined():
    return _groups_joined


def init_process_group(env, device_name, store=None, cpu_collectives=False):
    """Joins the run ``env`` describes: CUDA device from the local rank, NCCL on CUDA, gloo on CPU.

    ``cpu_collectives`` adds gloo beside NCCL for CPU tensors (FSDP with CPU offload clips and
    reduces host-side gradients). ``store`` replaces the MASTER_ADDR/PORT rendezvous (local spawn).
    """
    if store is None:  # env:// rendezvous (torchrun has set these; SLURM tasks have not)
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
    if wants_cuda(device_name):
        if not torch.cuda.is_available():
            raise ConfigError("DEVICE: 'cuda' was asked for but no CUDA device is available")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
        device_id = torch.device("cuda", torch.cuda.current_device())
    else:
        backend, device_id = "gloo", None
    global _groups_joined
    _groups_joined += 1
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        device_id=device_id,
        **kwargs,
    )


def init_single_process_group(device_name, cpu_collectives=False):
    """A process group of this process alone (engines work the same with one device); its
    store listens on a port the OS picks, so nothing can take the port meanwhile."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    env = ProcessEnv(0, 1, 0, "127.0.0.1", store.port, "spawn")
    init_process_group(env, device_name, store=store, cpu_collectives=cpu_collectives)


def destroy_process_group():
    if is_initialized():
        dist.destroy_process_group()


def exit_process(code, joined_before=0):
    """Ends this process with exit status ``code``.

    A process that has joined a process group (more than ``joined_before`` of them: a caller
    that is not the whole program, such as a test runner calling the command, passes the count
    it started with) leaves without the interpreter's teardown. The
    engines' objects (an FSDP2 device mesh, the pipeline's stages) keep the group's gloo context
    and its worker threads alive after the group is destroyed, and tearing them down while the
    interpreter finalises can abort the process (SIGABRT, "terminate called without an active
    exception") after a successful run. So: free everything now, while the interpreter is
    whole, wait for the data loader workers, flush the logs and exit at once. Any other process
    exits normally.
    """
    if _groups_joined <= joined_before:
        sys.exit(code)
    gc.collect()
    for child in multiprocessing.active_children():
        child.join(timeout=10)
        if child.is_alive():
            child.terminate()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------------------ #
# Preemption: SLURM (and torchrun, and submitit) warn with SIGTERM / SIGUSR1 before killing a job
# ------------------------------------------------------------------------------------------------ #

PREEMPTION_SIGNALS = signals.SIGNALS


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written: exits with PREEMPTED_EXIT_CODE (or
    INTERRUPTED_EXIT_CODE after a Ctrl-C)."""

    def __init__(self, code=PREEMPTED_EXIT_CODE):
        super().__init__(code)


_stop_pending = False


def stop_pending():
    """Whether this process has been signalled to stop (its checkpoint is yet to be written).

    The data loader asks: a loader worker that dies meanwhile (SLURM signals every process of a
    step, workers included) must not cost the checkpoint, so the loader then carries on in this
    process until the stop.
    """
    return _stop_pending


_CTRL_C_NOTE = (
    b"\npycls: Ctrl-C: stopping at the next sync point with a checkpoint; press Ctrl-C again to "
    b"abort at once (without one)\n"
)


class PreemptionFlag:
    """Set by SIGTERM / SIGUSR1 and by a first Ctrl-C (SIGINT); the training loop asks
    ``agreed()`` at its sync points. A second Ctrl-C aborts at once (KeyboardInterrupt).

    A signal can reach the processes of a run at slightly different times, so ``agreed()`` takes
    the maximum over all processes (one tiny all-reduce, only where the loop already syncs) and
    every process stops at the same iteration.
    """

    def __init__(self):
        self.requested = False
        self.interrupted = False  # by Ctrl-C: the run exits with INTERRUPTED_EXIT_CODE
        self._previous = {}
        self._sigchld = None  # the SIGCHLD handler set aside while stopping (see _handle)

    def install(self):
        """Installs the handlers (main thread only; elsewhere the flag just stays unset)."""
        try:
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        except ValueError:  # not the main thread of the main interpreter
            return self
        if signals.received():  # arrived during start-up (see signals)
            self._handle(PREEMPTION_SIGNALS[0], None)
        return self

    def uninstall(self):
        global _stop_pending
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self.interrupted:  # stopped by Ctrl-C: another press while exiting changes nothing
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self._sigchld is not None:
            signal.signal(signal.SIGCHLD, self._sigchld)
            self._sigchld = None
        _stop_pending = False

    def _handle(self, signum, frame):
        global _stop_pending
        self.requested = _stop_pending = True
        if self._sigchld is None:
            # torch's DataLoader raises from its SIGCHLD handler, wherever the main thread is
            # (mid-step included), when a worker dies. Once stopping, a dead worker is instead
            # noticed where the loader waits for it, between steps (see datasets.loader).
            previous = signal.getsignal(signal.SIGCHLD)  # None: set outside Python
            self._sigchld = signal.SIG_DFL if previous is None else previous
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def _interrupt(self, signum, frame):
        if self.interrupted:  # the second Ctrl-C: abort where the run is
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.interrupted = True
        self._handle(signum, frame)
        if get_rank() == 0:  # a terminal's Ctrl-C reaches every process: one note
            os.write(2, _CTRL_C_NOTE)

    def agreed(self, device):
        """Whether any process has been asked to stop (a collective when there are several)."""
        if get_world_size() == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        return bool(all_reduce_max(flag).item())
