"""Every read from a URL has a floor and an end: an attempt fails when a window of
``READ_TIMEOUT`` seconds passes in which fewer than ``MIN_READ_RATE`` bytes a second arrived (a
silent server, or one that trickles a byte a second), and a wait ends within seconds of a stop
signal (pycls.signals).

Each attempt of a read (``pycls.datasets.transport.http_files.attempt``) runs under a ``Watch`` of
its thread: the bytes its answers bring (counted as they arrive, headers included) and the
connections it uses (``link``). One thread per process (the watchdog) looks at the watches a few
times a second and cuts an attempt that falls below the floor, or that still waits ``STOP_GRACE``
seconds after a stop (reads that finish sooner, as almost all do, are left alone: a run then stops
at its next step boundary as usual): it shuts the attempt's sockets down, which ends a blocked read
at once, and the attempt then fails with what was seen (``Watch.words``) or raises ``WaitStopped``.
A retry's pause (``pause``) and an index build (``check_stop``) end on the stop too.

The socket's own timeout (the window) still bounds what cannot be cut: connecting, before a
socket exists. Reads of other protocols (fsspec's) are not counted: only the stop ends their
pauses and their next attempt.
"""

import contextlib
import http.client
import io
import os
import socket
import threading
import time

from pycls import signals
from pycls.errors import WaitStopped

# The window: seconds an attempt may go without MIN_READ_RATE bytes a second (DATA_LOADER.
# READ_TIMEOUT); a server silent that long fails the attempt
READ_TIMEOUT = 60.0
# The floor: bytes a second an attempt must average over each window (DATA_LOADER.
# MIN_READ_RATE_KB): a 256 MiB shard read whole is then over within 4.6 hours at worst, an 8 MiB
# range within 9 minutes, and a server that trickles a byte a second fails at the first window
MIN_READ_RATE = 16 << 10
# Seconds a read may go on after a stop signal: one that finishes (nearly all do, in
# milliseconds) lets the run stop at its next step boundary; one still waiting is cut
STOP_GRACE = 3.0
# How often the watchdog looks
_TICK = 0.25

_local = threading.local()


class Watch:
    """One attempt of a read: what arrived (``received``), the connections it uses, and why it
    was cut (``cut``: None, "floor" or "stop")."""

    __slots__ = ("started", "received", "mark", "marked", "window", "floor", "links", "cut",
                 "seen", "server")  # fmt: skip

    def __init__(self):
        self.started = self.mark = time.monotonic()
        self.received = self.marked = 0
        self.window, self.floor = None, None  # armed by the first connection it uses
        self.links, self.cut, self.seen, self.server = [], None, (0, 0.0), ""

    def arm(self, window: float, floor: float, server: str) -> None:
        if self.window is None:
            self.window, self.floor, self.server = float(window), float(floor), server
            self.mark, self.marked = time.monotonic(), self.received

    def words(self) -> str:
        """What was seen, for the message of a cut attempt."""
        got, seconds = self.seen
        if got == 0:
            return f"no answer from {self.server} for {seconds:.3g} s (timed out)"
        return (
            f"{self.server} sent {got:,} bytes in {seconds:.3g} s ({got / seconds:,.0f} bytes/s), "
            f"below the floor of {self.floor / 1024:g} KiB/s over {self.window:g} s "
            "(DATA_LOADER.MIN_READ_RATE_KB, DATA_LOADER.READ_TIMEOUT)"
        )

    def _look(self, now: float, stop: float | None) -> None:
        """Cuts the attempt where it falls below the floor, or outlasts a stop's grace."""
        if stop is not None and now - max(self.started, stop) >= STOP_GRACE:
            self._cut("stop")
        elif self.window is not None and now - self.mark >= self.window:
            got = self.received - self.marked
            if got < self.floor * (now - self.mark):
                self.seen = (got, now - self.mark)
                self._cut("floor")
            else:
                self.mark, self.marked = now, self.received

    def _cut(self, why: str) -> None:
        if self.cut is None:
            self.cut = why
            for end in self.links:
                end()


class _Watchdog:
    """The thread of a process that looks at its watches (started with the first one)."""

    def __init__(self):
        self.watches: set = set()
        self.lock = threading.Condition()
        self.started = False

    def forked(self) -> None:
        """In a forked child (a loader worker): the parent's thread is not there, and its lock
        may have been held at the fork."""
        self.__init__()

    def add(self, watch: Watch) -> None:
        with self.lock:
            if not self.started:
                self.started = True
                threading.Thread(target=self._run, name="pycls-read-deadlines", daemon=True).start()
            self.watches.add(watch)
            self.lock.notify()

    def remove(self, watch: Watch) -> None:
        with self.lock:
            self.watches.discard(watch)

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.watches:
                    self.lock.wait()
                watches = list(self.watches)
            now, stop = time.monotonic(), signals.stop_time()
            for watch in watches:
                watch._look(now, stop)
            time.sleep(_TICK)


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.forked)
# A second SIGTERM ends a process that waits on a read (pycls.signals)
signals.count_waits(lambda: bool(_WATCHDOG.watches))


@contextlib.contextmanager
def watching():
    """A Watch for one attempt of a read in this thread (the current one until it ends)."""
    watch, outer = Watch(), getattr(_local, "watch", None)
    _local.watch = watch
    _WATCHDOG.add(watch)
    try:
        yield watch
    finally:
        _WATCHDOG.remove(watch)
        _local.watch = outer


def current() -> Watch | None:
    return getattr(_local, "watch", None)


def shut(sock) -> None:
    """Ends every read of ``sock``, in any thread, at once (its descriptor stays open until its
    owner closes it: no other file can take its number meanwhile)."""
    with contextlib.suppress(OSError):  # closed meanwhile: nothing to end
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def link(end, window: float, floor: float, server: str) -> None:
    """A connection of ``server`` serves this thread's attempt, held to ``window`` and
    ``floor``; a cut calls ``end()`` (which shuts its socket)."""
    watch = current()
    if watch is None:
        return
    watch.arm(window, floor, server)
    watch.links.append(end)
    if watch.cut is not None:  # cut before the connection was linked
        end()


def count(size: int) -> None:
    watch = getattr(_local, "watch", None)
    if watch is not None:
        watch.received += size


def stopped(what: str) -> WaitStopped:
    """The error of a wait for ``what`` that this process's stop ended."""
    words = signals.stop_words()
    return WaitStopped(f"{words} ended the wait for {what}", 130 if words == "Ctrl-C" else 75)


def check_stop(what: str) -> None:
    """Raises WaitStopped when a stop has come (an index build asks between its steps)."""
    if signals.stop_time() is not None:
        raise stopped(what)


def pause(seconds: float, what: str) -> None:
    """Waits ``seconds`` (a retry's pause), or less: a stop ends it with WaitStopped."""
    end = time.monotonic() + seconds
    while True:
        check_stop(what)
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, _TICK))


# ------------------------------------------------------------------------------------------------ #
# Counting what arrives: http.client's response reads its socket through ``makefile`` only
# ------------------------------------------------------------------------------------------------ #


class _Counted:
    """A socket whose answers count their bytes toward the attempt that reads them."""

    def __init__(self, sock):
        self.sock = sock

    def makefile(self, mode, *args, **kwargs):
        return io.BufferedReader(_CountingIO(self.sock.makefile("rb", buffering=0)))


class _CountingIO(io.RawIOBase):
    def __init__(self, raw):
        super().__init__()
        self.raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        size = self.raw.readinto(buffer)
        if size:
            count(size)
        return size

    def close(self) -> None:
        self.raw.close()
        super().close()


class CountedResponse(http.client.HTTPResponse):
    """http.client's answer (``HTTPConnection.response_class``), every byte it reads from its
    socket counted toward the attempt of the thread that reads it (``count``)."""

    def __init__(self, sock, *args, **kwargs):
        super().__init__(_Counted(sock), *args, **kwargs)
