"""Stop signals that arrive before the trainer listens for them, and the stop that every wait for
data honours.

SLURM may deliver its warning (``--signal=USR1@N``) or a preemption SIGTERM seconds after a job
step starts, while the process is still importing torch and building the model: by default
SIGUSR1 and SIGTERM would end it there, with nothing saved and an exit status that does not ask
for a requeue. ``tools/run_net.py`` calls ``hold()`` first thing, so such a signal is recorded
instead; training then treats it like one that arrives mid-epoch (it checkpoints at its first
sync point and exits with status 75), and the other modes ``release()`` it. No torch import here:
this must be cheap enough to run before everything else.

A stop is also what a wait for data ends on (``stop_time``): a read from a URL still waiting
``pycls.datasets.transport.http_files.STOP_GRACE`` seconds after the stop, a retry's pause or an
index build ends with ``pycls.errors.WaitStopped`` instead of holding the run past its stop. A
loader worker ignores the signals themselves (its main process decides when to stop) but follows its
main process's stop through a flag they share (``share_stops``, ``follow_stops``). A second SIGTERM
while the process waits for data ends it at once, as a second Ctrl-C does; one that comes within
``REPEAT_AFTER`` seconds of the first is the same stop delivered twice (a process group's signal and
a parent passing it on) and changes nothing. Elsewhere (writing the stop's checkpoint, in a
collective) a second SIGTERM changes nothing either: a launcher sends one to the other processes
when the first exits, and their checkpoint must not be cut short.
"""

import os
import signal
import time

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A second SIGTERM this many seconds after the first stop ends the process; sooner, it is the
# same stop twice (SLURM signals every process of a step, and a launcher passes it on too)
REPEAT_AFTER = 1.0
_received = []
# The first stop of this process: [monotonic time, signal number], or empty
_stop = []
# Flags (multiprocessing RawValues) this process shares with its loader workers, and the one its
# own parent shares with it (a loader worker)
_shared = []
_followed = []
# Whether the process waits for data now (each a callable the data readers register)
_waiting = []


def _record(signum, frame):
    _received.append(signum)
    if note_stop(signum):
        end_now(signum)


def hold():
    """Records SIGTERM / SIGUSR1 from now on instead of dying of them (main thread only)."""
    for sig in SIGNALS:
        signal.signal(sig, _record)


def received():
    """Whether a stop signal arrived while held."""
    return bool(_received)


def release():
    """Default handling again; a signal that arrived while held is delivered now."""
    clear_stop()
    for sig in SIGNALS:
        if signal.getsignal(sig) is _record:
            signal.signal(sig, signal.SIG_DFL)
    for sig in dict.fromkeys(_received):
        signal.raise_signal(sig)


def note_stop(signum):
    """Records a stop signal (called by the handlers); True when it is a second SIGTERM, at least
    REPEAT_AFTER seconds after the first stop, that comes while the process waits for data: it
    ends the process (``end_now``)."""
    now = time.monotonic()
    if not _stop:
        _stop[:] = [now, signum]
        for flag in _shared:
            flag.value = signum
        return False
    repeated = signum == signal.SIGTERM and now - _stop[0] >= REPEAT_AFTER
    return repeated and any(waits() for waits in _waiting)


def count_waits(waits):
    """``waits()`` says whether this process waits for data now (a read in flight)."""
    _waiting.append(waits)


def end_now(signum):
    """Ends the process of the signal ``signum`` (its default action: no checkpoint, no clean-up),
    as the second of two stops asks."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def clear_stop():
    """Forgets the stop (a run ended, the next one in this process starts afresh)."""
    _stop.clear()
    for flag in _shared:
        flag.value = 0


def share_stops(flag):
    """From now on this process's stops set ``flag`` (a RawValue its loader workers follow)."""
    if not any(f is flag for f in _shared):
        _shared.append(flag)
    if _stop:
        flag.value = _stop[1]


def follow_stops(flag):
    """A loader worker's stop is its main process's (``flag``, shared with it)."""
    _followed[:] = [flag]


def stop_time():
    """The monotonic time of this process's stop (or its main process's, first seen now), or
    None while there is none."""
    if _followed:
        if not _followed[0].value:
            _stop.clear()
        elif not _stop:
            _stop[:] = [time.monotonic(), _followed[0].value]
    return _stop[0] if _stop else None


def stop_signal():
    """The signal of the stop (None: no stop)."""
    return _stop[1] if stop_time() is not None else None


def stop_words(signum=None):
    """The stop's signal in words: "SIGTERM", "Ctrl-C" ..."""
    signum = stop_signal() if signum is None else signum
    if signum == signal.SIGINT:
        return "Ctrl-C"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "a stop signal"
