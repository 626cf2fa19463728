"""Stop signals that arrive before the trainer listens for them.

SLURM may deliver its warning (``--signal=USR1@N``) or a preemption SIGTERM seconds after a job
step starts, while the process is still importing torch and building the model: by default
SIGUSR1 and SIGTERM would end it there, with nothing saved and an exit status that does not ask
for a requeue. ``tools/run_net.py`` calls ``hold()`` first thing, so such a signal is recorded
instead; training then treats it like one that arrives mid-epoch (it checkpoints at its first
sync point and exits with status 75), and the other modes ``release()`` it. No torch import here:
this must be cheap enough to run before everything else.
"""

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received = []


def _record(signum, frame):
    _received.append(signum)


def hold():
    """Records SIGTERM / SIGUSR1 from now on instead of dying of them (main thread only)."""
    for sig in SIGNALS:
        signal.signal(sig, _record)


def received():
    """Whether a stop signal arrived while held."""
    return bool(_received)


def release():
    """Default handling again; a signal that arrived while held is delivered now."""
    for sig in SIGNALS:
        if signal.getsignal(sig) is _record:
            signal.signal(sig, signal.SIG_DFL)
    for sig in dict.fromkeys(_received):
        signal.raise_signal(sig)
