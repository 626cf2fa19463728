"""A loader worker that dies mid-epoch (the out-of-memory killer, a kill -9), named in one line
with its index, pid and signal, and its iterator's workers ended: wherever torch reports it (the
next batch read, or its SIGCHLD handler, which raises in whatever the main thread runs)."""

import contextlib
import re
import signal
import time
import weakref
from collections.abc import Iterator

from pycls.errors import EnvironmentFailure

# How torch reports a dead loader worker: "DataLoader worker (pid ...) exited unexpectedly"
# (RuntimeError), or, when it dies while the main process reads its pipe or receives a tensor's
# file descriptor from it, a reset connection or an end of file
WORKER_DIED = (RuntimeError, ConnectionError, EOFError)
# How long a worker whose pipe closed may take to be seen dead (its exit status collected)
_DEATH_SEEN_S = 2.0


class LoaderWorkerDied(EnvironmentFailure, RuntimeError):
    """A loader worker process died mid-epoch (killed by a signal: the out-of-memory killer, a
    user's kill): the machine's failure, named in one line with the worker and its signal."""


def dead_worker(batches: Iterator, error: BaseException) -> LoaderWorkerDied | None:
    """The worker of ``batches`` (torch's multi-process iterator) that died, as one line, or None
    when none did (``error`` was another failure, raised in a worker and passed on)."""
    workers, text = list(getattr(batches, "_workers", None) or []), str(error)
    # torch's words for a dead worker; an error a worker raised comes with its traceback
    if isinstance(error, RuntimeError) and "DataLoader worker (pid" not in text:
        return None
    if not workers or "Original Traceback" in text:
        return None
    deadline = time.monotonic() + _DEATH_SEEN_S  # its pipe closes as it dies: wait to see it
    while True:
        dead = [(k, w) for k, w in enumerate(workers) if w.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            break
        with worker_reports_absorbed():
            time.sleep(0.01)
    if not dead:
        return None
    k, worker = dead[0]
    code = worker.exitcode
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
    kill = " (sent by the system's out-of-memory killer, or a kill -9)" if code == -9 else ""
    return LoaderWorkerDied(
        f"data loader worker {k} of {len(workers)} (pid {worker.pid}) {how}{kill} mid-epoch: the "
        "run stops here; rerun the same command to resume from the last checkpoint it wrote, "
        "if any"
    )


# The multi-process iterators of the epochs under way (their workers, for dead_worker_report)
_RUNNING = weakref.WeakSet()


def watch(batches: Iterator) -> None:
    """Names ``batches`` (torch's multi-process iterator) to ``dead_worker_report``."""
    _RUNNING.add(batches)


# torch's report of a reaped worker, raised by its SIGCHLD handler wherever the main thread is
_REAPED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal")


def dead_worker_report(error: BaseException) -> LoaderWorkerDied | None:
    """The one line of a loader worker that died, for torch's report of it raised away from the
    loader (the main thread was in the step when the worker was reaped: torch's SIGCHLD handler
    raises where it is), its iterator's workers ended; None for any other error."""
    found = _REAPED.search(str(error)) if isinstance(error, RuntimeError) else None
    if found is None:
        return None
    for batches in list(_RUNNING):
        if int(found.group(1)) in [w.pid for w in getattr(batches, "_workers", ())]:
            died = dead_worker(batches, error)
            with worker_reports_absorbed():
                shut_down_workers(None, batches)
            return died
    return None


@contextlib.contextmanager
def worker_reports_absorbed():
    """Within the block, torch's report of a dead worker is dropped: its SIGCHLD handler raises
    it wherever the main thread is as the worker is reaped, here where that death is being
    handled already (escaping, it replaced the one line with torch's traceback)."""
    try:
        yield
    except RuntimeError as e:
        if "DataLoader worker (pid" not in str(e):
            raise


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def shut_down_workers(loader, batches: Iterator) -> None:
    """Ends the worker processes of ``batches`` (``loader``'s iterator) now: after an error that
    ends the run, which would otherwise keep them for as long as its traceback lives (the run's
    frames hold the loader, a persistent loader its workers; a caller that goes on after the
    error, as a test or a notebook does, kept them until a garbage collection)."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # torch's multi-process iterator
    if shutdown is not None:
        shutdown()
    if loader is not None and getattr(loader, "_iterator", None) is batches:  # starts afresh
        loader._iterator = None
