"""Starting the processes of a run: this one, NUM_PROCS local ones, or torchrun's / srun's.

- Under torchrun or srun, this process is one of many: it joins their process group.
- ``NUM_PROCS G`` (G > 1) spawns G processes here (torch.multiprocessing, a free local port).
- One process with TRAIN.PARALLEL other than none joins a process group of one, so every engine
  (and its checkpoints) works the same on a single device.

Each process uses its share of the CPUs (``distributed.cpu_threads``: SLURM_CPUS_PER_TASK, the
affinity mask divided by the processes on the machine, unless OMP_NUM_THREADS or CPU_THREADS say
otherwise). Every process leaves its process group on the way out, errors included.
"""

import faulthandler
import logging
import os
import signal

import torch

from pycls import distributed as dist
from pycls import signals
from pycls.distributed.preflight import check_launch
from pycls.errors import (
    EXIT_DIVERGED,
    EXIT_ENVIRONMENT,
    EXIT_USER_ERROR,
    REPORTED,
    DivergedError,
    EnvironmentFailure,
    ReportedError,
    ReportedFailure,
    reported,
)

logger = logging.getLogger(__name__)


def launch(fn, settings, *args):
    """Runs ``fn(*args)`` in every process of the run as ``settings`` (a LaunchSettings)
    describe it; returns fn's result in this process. ``args`` travel to spawned processes as
    they are (pickled)."""
    env = dist.launcher_env()
    # A setting that cannot work with this many processes stops here, before any starts (the
    # rest of the config was checked when it loaded)
    check_launch(settings, env.world_size if env is not None else max(settings.num_procs, 1))
    if env is not None:
        advice = dist.agent_store_advice()
        if env.rank == 0 and advice is not None:
            logger.warning(
                "torchrun may restart these workers, over one store shared with its agents: a "
                f"restarted worker can read a dead one's address and fail to connect. {advice} "
                '(docs/distributed.md, "Several machines with torchrun")'
            )
        dist.set_cpu_threads(settings.cpu_threads)
        return _run(fn, settings, args, env)
    if settings.num_procs > 1:
        return _spawn(fn, settings, args)
    dist.set_cpu_threads(settings.cpu_threads)  # a SLURM task of its own, or the CPU_THREADS key
    if settings.engine != "none":
        return _run(fn, settings, args, None)
    return fn(*args)


def _run(fn, settings, args, env, store=None):
    """fn(*args) as one process of ``env`` (None: a process group of this process alone)."""
    cpu = settings.cpu_collectives
    if env is None:
        dist.init_single_process_group(settings.device, cpu_collectives=cpu)
    else:
        dist.init_process_group(env, settings.device, store=store, cpu_collectives=cpu)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ #
# Local spawn (NUM_PROCS)
# ------------------------------------------------------------------------------------------------ #


class ProcessDied(EnvironmentFailure):
    """A spawned process died of a signal (SIGKILL: the out-of-memory killer, a scheduler, a
    user): the machine's failure, reported in one line with exit status 1; the launcher's
    traceback is kept for the log file (``__cause__``)."""


_USER_ERROR_KEY = dist.USER_ERROR_KEY
_ENVIRONMENT_ERROR_KEY = dist.ENVIRONMENT_ERROR_KEY


def _spawn(fn, settings, args):
    """Starts NUM_PROCS processes on this machine and waits for them.

    The rendezvous store lives in this (parent) process on a port the OS picked, so there is no
    race for a free port. SIGTERM / SIGUSR1 sent to the parent are passed on to the children,
    which checkpoint and stop; the parent then exits with the children's status.
    """
    nprocs = settings.num_procs
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, world_size=nprocs + 1, is_master=True, wait_for_workers=False
    )
    ctx = torch.multiprocessing.start_processes(
        _spawned_main,
        args=(fn, settings, args, store.port, nprocs),
        nprocs=nprocs,
        start_method="spawn",
        join=False,
    )

    def forward(signum, frame):
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signum)

    interrupts = []

    def interrupt(signum, frame):
        # A terminal's Ctrl-C reaches the children too: the first stops them with a checkpoint
        # (their own handler), the second aborts them and this process
        if interrupts:
            raise KeyboardInterrupt
        interrupts.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in dist.PREEMPTION_SIGNALS}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    if signals.received():  # a stop that came while this process was starting
        forward(dist.PREEMPTION_SIGNALS[0], None)
    # torch warns when it stops the other processes after one failed; the failure itself (a
    # traceback, or a user mistake's one line) says what happened
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        while not ctx.join():
            pass
    except torch.multiprocessing.ProcessExitedException as e:
        if e.exit_code in (dist.PREEMPTED_EXIT_CODE, dist.INTERRUPTED_EXIT_CODE):
            raise dist.Preempted(e.exit_code) from None
        if e.exit_code == EXIT_USER_ERROR:  # a user mistake: the child left its one line
            found = store.check([_USER_ERROR_KEY])
            line = store.get(_USER_ERROR_KEY).decode() if found else "error: see the log above"
            raise ReportedError(line) from None
        if e.exit_code == EXIT_ENVIRONMENT and store.check([_ENVIRONMENT_ERROR_KEY]):
            raise ReportedFailure(store.get(_ENVIRONMENT_ERROR_KEY).decode()) from None
        if e.exit_code == EXIT_DIVERGED:
            found = store.check([_USER_ERROR_KEY])
            raise DivergedError(store.get(_USER_ERROR_KEY).decode() if found else "") from None
        if e.exit_code is not None and e.exit_code < 0:  # a signal: nothing of its own to say
            raise ProcessDied(
                f"process {e.error_index} of {nprocs} died of {e.signal_name} (killed by the "
                "system, a scheduler or a user; a native crash prints its stacks above) and the "
                "others were stopped; TRAIN.AUTO_RESUME continues from the last checkpoint"
            ) from e
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return None


def _spawned_main(index, fn, settings, args, port, nprocs):
    # A crash in native code (a collective, a kernel) prints every thread's Python stack
    faulthandler.enable(all_threads=True)
    signals.hold()  # a stop forwarded by the parent while this one starts is kept
    # Processes sharing a machine's cores: without this each would start one thread per core
    dist.set_cpu_threads(settings.cpu_threads, nprocs=nprocs)
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=nprocs + 1, is_master=False)
    env = dist.ProcessEnv(index, nprocs, index, "127.0.0.1", port, "spawn")
    try:
        _run(fn, settings, args, env, store=store)
        code = 0
    except DivergedError as e:  # every process sees the same loss: the parent says it once
        store.set(_USER_ERROR_KEY, str(e))
        code = EXIT_DIVERGED
    except REPORTED as e:  # a mistake or the machine's failure: the parent prints it, once
        code, line = reported(e)
        key = _ENVIRONMENT_ERROR_KEY if code == EXIT_ENVIRONMENT else _USER_ERROR_KEY
        store.set(key, line)
    except KeyboardInterrupt:  # a second Ctrl-C: the parent says so
        code = dist.INTERRUPTED_EXIT_CODE
    except dist.Preempted as e:  # its checkpoint is written
        code = e.code
    dist.exit_process(code)  # it joined a process group: no teardown (exit_process)
