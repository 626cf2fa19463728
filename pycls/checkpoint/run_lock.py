"""One training run per OUT_DIR: ``OUT_DIR/run.lock``, taken by rank 0 at start.

The lock file holds the holder's host, pid and start time (JSON). It is created with
``O_CREAT | O_EXCL``, which is atomic on local file systems and on NFSv3+ / Lustre / GPFS, so two
runs starting together cannot both take it. A second run refuses at start with ``RunLockedError``
naming the holder. A lock whose pid no longer exists on this host is stale (the run was killed
with -9, or its machine rebooted): it is taken over with a warning, by renaming it aside first so
that of two runs taking over at once only one wins.

Across hosts (a shared file system): exclusion holds (the create is atomic), but whether a holder
on *another* host is still alive cannot be checked from here, so such a lock is never taken over
automatically (except by a requeued attempt of the same SLURM job, whose earlier attempt has
ended); the error says which host and pid hold it and how to remove it (``rm
OUT_DIR/run.lock``) once you know that run is gone. The lock is removed when the run ends, also
on errors and preemption (exit 75), so a requeued job finds it free.
"""

import contextlib
import json
import logging
import os
import socket
import time

from pycls.errors import UserError

LOCK_FILE = "run.lock"
logger = logging.getLogger(__name__)


class RunLockedError(UserError, RuntimeError):
    """Another run holds OUT_DIR."""


def _holder_text(info, path):
    start = info.get("start_time")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)) if start else "?"
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, started {when} ({path})"


def _read(path):
    try:
        with open(path) as f:
            info = json.load(f)
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # exists (another user's), or unreadable: assume alive
    return True


class RunLock:
    """``with RunLock(out_dir):`` holds OUT_DIR for this process (``acquire``/``release``).
    ``name``, ``busy`` (what the refusal says is busy) and ``hint`` (what to do; ``{path}`` is
    the lock) let other folders be held the same way (the sweep launcher's)."""

    def __init__(self, out_dir, name=LOCK_FILE, busy=None, hint=None):
        self.path = os.path.join(out_dir, name)
        self.busy = busy or f"OUT_DIR {out_dir} is in use by another run"
        self.hint = hint or "Use another OUT_DIR, or, if that run is gone, remove {path}"
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": time.time()}
        if os.environ.get("SLURM_JOB_ID"):
            self.info["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        self.held = False

    def acquire(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(3):  # a stale lock taken over, then created: at most a few rounds
            if self._create():
                self.held = True
                return self
            holder = _read(self.path)
            if not self._stale(holder):
                break
            if self._take_over(holder):
                continue
        holder = _read(self.path)
        raise RunLockedError(
            f"{self.busy}: {_holder_text(holder, self.path)}. {self.hint.format(path=self.path)}"
        )

    def _create(self):
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.info, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a full disk: an empty lock left would refuse every later run
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise OSError(e.errno, e.strerror, self.path) from None
        return True

    def _stale(self, holder):
        if not holder:  # being written this instant, or unreadable: not ours to judge
            return False
        job = self.info.get("slurm_job_id")
        if job and holder.get("slurm_job_id") == job and holder.get("pid") != self.info["pid"]:
            return True  # an earlier attempt of this SLURM job (requeued: that one has ended)
        same_host = holder.get("host") == self.info["host"]
        return same_host and not _pid_alive(holder.get("pid"))

    def _take_over(self, holder):
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)  # only one of several runs taking over succeeds
        except FileNotFoundError:
            return True  # someone else removed it: try to create again
        if _read(aside) != holder:  # replaced by a live run in between: put it back
            with contextlib.suppress(OSError):
                os.rename(aside, self.path)
            return False
        os.remove(aside)
        logger.warning(
            f"took over the stale lock of a run that is gone ({_holder_text(holder, self.path)})"
        )
        return True

    def release(self):
        if not self.held:
            return
        self.held = False
        if _read(self.path) == self.info:  # still ours (not removed by hand and retaken)
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def live_holder(out_dir):
    """Who holds OUT_DIR's lock ("host H, pid P, started ..."), or None when it is free or
    stale (its process is gone from this host). A holder on another host counts as live."""
    lock = RunLock(out_dir)
    if not os.path.exists(lock.path):
        return None
    holder = _read(lock.path)
    return None if holder and lock._stale(holder) else _holder_text(holder, lock.path)


def refuse_if_held(out_dir):
    """RunLockedError, as a run starting there would raise it, when a live run holds OUT_DIR
    now: asked before the slow imports, so that the answer comes in a second. (The run still
    takes the lock itself, atomically: this only answers early.)"""
    holder = live_holder(out_dir)
    if holder is not None:
        lock = RunLock(out_dir)
        raise RunLockedError(f"{lock.busy}: {holder}. {lock.hint.format(path=lock.path)}")


def hold_out_dir(out_dir, is_main, share=None):
    """Rank 0 takes the lock; ``share(error_or_None)`` hands rank 0's outcome to every process
    (a broadcast), so that all of them stop when it failed. Returns the lock (rank 0) or None."""
    lock, error = None, None
    if is_main:
        try:
            lock = RunLock(out_dir).acquire()
        except RunLockedError as e:
            error = str(e)
    if share is not None:
        error = share(error)
    if error:
        raise RunLockedError(error)
    return lock
