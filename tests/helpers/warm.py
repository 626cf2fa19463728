"""Processes that start warm: forked by a fork server (multiprocessing's, one per test process)
that imported torch and pycls once, from its single thread. A fresh interpreter spends about 5 s
of CPU importing them; the spawned process groups of the engine tests and the docs' commands
start in milliseconds instead. Each process is still a process of its own (its own environment,
folder, exit status and output); how a run's processes start for real is what the NUM_PROCS,
torchrun, SLURM and wheel tests check, in fresh interpreters.

Where there is no fork server (not Linux), processes are spawned (fresh interpreters)."""

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile

from torch.multiprocessing import start_processes as _TORCH_START_PROCESSES

START_METHOD = "forkserver" if sys.platform == "linux" else "spawn"
# What the fork server imports before it forks anything (the rest each process imports itself)
PRELOAD = ["pycls.core.trainer", "pycls.core.cli", "tests.helpers.distributed"]


def start_method():
    """The start method of warm processes, the fork server told what to import first."""
    if START_METHOD == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return START_METHOD


def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, **caller):
    """torch.multiprocessing.start_processes in warm processes (the caller's ``start_method`` is
    not used: the fork server starts them)."""
    return _TORCH_START_PROCESSES(fn, args, nprocs, join, daemon, start_method())


def _main(argv, env, cwd, out, err):
    """``python ARGV`` in this process: a script, ``-m module`` or ``-c code``; the exit
    functions run at the end, as an interpreter's do."""
    try:
        _run(argv, env, cwd, out, err)
    finally:
        atexit._run_exitfuncs()


def _run(argv, env, cwd, out, err):
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def run_python(cmd, env, cwd, timeout):
    """What ``subprocess.run(cmd, capture_output=True, text=True, ...)`` returns for a command
    ``[sys.executable, ...]``, run in a warm process."""
    assert cmd[0] == sys.executable, cmd
    context = multiprocessing.get_context(start_method())
    with tempfile.TemporaryDirectory(prefix="pycls-warm-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = context.Process(target=_main, args=(cmd[1:], dict(env), cwd, out, err))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(cmd, timeout)
        with open(out, errors="replace") as o, open(err, errors="replace") as e:
            return subprocess.CompletedProcess(cmd, process.exitcode, o.read(), e.read())


class Started:
    """A ``python`` command running in a warm process, not waited for (``start``): a test signals
    it (``pid``) while it runs, then ``wait``s for its exit status and output."""

    def __init__(self, cmd, env, cwd):
        self._tmp = tempfile.TemporaryDirectory(prefix="pycls-warm-")
        self.out, self.err = (os.path.join(self._tmp.name, n) for n in ("stdout", "stderr"))
        context = multiprocessing.get_context(start_method())
        self.process = context.Process(target=_main, args=(cmd[1:], env, cwd, self.out, self.err))
        self.process.start()
        self.pid = self.process.pid

    def wait(self, timeout):
        """(exit status, stdout, stderr); the process is killed first if it outlives
        ``timeout`` (and the status is then None)."""
        self.process.join(timeout)
        status = None if self.process.is_alive() else self.process.exitcode
        if status is None:
            self.process.kill()
            self.process.join()
        with open(self.out, errors="replace") as o, open(self.err, errors="replace") as e:
            out, err = o.read(), e.read()
        self._tmp.cleanup()
        return status, out, err


def start(cmd, env=None, cwd=None):
    """``python ...`` (``cmd[0]`` is ``sys.executable``) started in a warm process: a Started."""
    from tests.helpers import ROOT

    assert cmd[0] == sys.executable, cmd
    env = dict(os.environ if env is None else env)
    return Started(cmd, env, ROOT if cwd is None else str(cwd))


def run(cmd, env=None, cwd=None, timeout=None):
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``, a ``python`` command (a
    script, ``-c``, ``-m pycls``) in a warm process: for the tests whose point is what the
    command does, not how an interpreter starts (imports, signals during start-up, exit).
    ``timeout``: by default 600 s scaled with the machine's load (``tests.helpers.scaled``)."""
    from tests.helpers import ROOT, scaled

    timeout = scaled(600) if timeout is None else timeout

    env = dict(os.environ if env is None else env)
    cwd = ROOT if cwd is None else str(cwd)
    if cmd[0] == sys.executable and (cmd[1] != "-m" or cmd[2] == "pycls"):
        return run_python(cmd, env, cwd, timeout)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
