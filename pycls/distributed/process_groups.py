"""Joining and leaving the run's process group: the CPU threads and CUDA device of this process,
NCCL or gloo, a group of one process, and the exit of a process that had one."""

import gc
import logging
import multiprocessing
import os
import sys

import torch
import torch.distributed as dist

from pycls.distributed.environments import ProcessEnv, cpu_threads
from pycls.distributed.ranks import is_initialized
from pycls.errors import ConfigError


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
# (host, port) of the rendezvous store of the group joined last
_store_address = None
# Where a spawned process (NUM_PROCS) leaves its one-line error for the parent, in that store
USER_ERROR_KEY = "pycls_user_error"
ENVIRONMENT_ERROR_KEY = "pycls_environment_error"
# torch's flight recorder of NCCL collectives: the entries it keeps (set before the group starts,
# where the environment does not say otherwise), and a record written when a collective times out
FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def groups_joined():
    return _groups_joined


def init_process_group(env, device_name, store=None, cpu_collectives=False):
    """Joins the run ``env`` describes: CUDA device from the local rank, NCCL on CUDA, gloo on CPU.

    ``cpu_collectives`` adds gloo beside NCCL for CPU tensors (FSDP with CPU offload clips and
    reduces host-side gradients). ``store`` replaces the MASTER_ADDR/PORT rendezvous (local spawn).
    """
    global _groups_joined, _store_address
    _store_address = (env.master_addr, env.master_port)
    if store is None:  # env:// rendezvous (torchrun has set these; SLURM tasks have not)
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        _store_address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if wants_cuda(device_name):
        for key, value in FLIGHT_RECORDER.items():
            os.environ.setdefault(key, value)
        if not torch.cuda.is_available():
            raise ConfigError("DEVICE: 'cuda' was asked for but no CUDA device is available")
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
        device_id = torch.device("cuda", torch.cuda.current_device())
    else:
        backend, device_id = "gloo", None
    _groups_joined += 1
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        device_id=device_id,
        **kwargs,
    )


def store_address():
    """(host, port) of the rendezvous store the processes met at (the launcher's, torchrun's
    agent's or rank 0's), which a thread may reach while the process group is blocked; None
    without a process group."""
    return _store_address if is_initialized() else None


def side_group():
    """A gloo group of every process beside the run's own, for collectives that a background
    thread calls while the main thread calls the run's (asynchronous checkpoints); None without
    a process group. Every process must call it at the same point."""
    if not is_initialized():
        return None
    return dist.new_group(backend="gloo")


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
