"""Preemption: SLURM (and torchrun, and submitit) warn with SIGTERM / SIGUSR1 before killing a
job; the training loop stops at a sync point every process agrees on, writes a checkpoint and
exits with PREEMPTED_EXIT_CODE (INTERRUPTED_EXIT_CODE after a Ctrl-C). A wait for data that the
stop ends (``pycls.errors.WaitStopped``) stops the run where it waited: ``stop_at``."""

import contextlib
import logging
import os
import signal

import torch

from pycls import signals
from pycls.distributed.ranks import all_reduce_max, get_rank, get_world_size
from pycls.errors import WaitStopped, original_message

logger = logging.getLogger(__name__)

# Exit status of a run stopped by SIGTERM / SIGUSR1 after writing a checkpoint: EX_TEMPFAIL from
# sysexits.h ("try again later"), so a job script can requeue on it and auto-resume picks it up
PREEMPTED_EXIT_CODE = 75
# Exit status of a run stopped by Ctrl-C (SIGINT) after writing a checkpoint: a shell's status for
# Ctrl-C (128 + 2), so that a job script does not take the user's stop for a preemption
INTERRUPTED_EXIT_CODE = 130


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
        if signals.received():  # arrived during start-up (see signals): the same stop, not a second
            self._stopping()
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
        signals.clear_stop()

    def _handle(self, signum, frame):
        if signals.note_stop(signum):  # a second SIGTERM while it waits on a read: at once
            signals.end_now(signum)
        self._stopping()

    def _stopping(self):
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
        signals.note_stop(signum)
        self._stopping()
        if get_rank() == 0:  # a terminal's Ctrl-C reaches every process: one note
            os.write(2, _CTRL_C_NOTE)

    def agreed(self, device):
        """Whether any process has been asked to stop (a collective when there are several)."""
        if get_world_size() == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        return bool(all_reduce_max(flag).item())


@contextlib.contextmanager
def stop_at(stop, *point):
    """Runs the block; a wait for data in it that a stop signal ended (WaitStopped) calls
    ``stop(*point)`` (the trainer's: the checkpoint of ``point``, then Preempted). With several
    processes the others may be inside a collective of the next step, where no checkpoint can
    meet them: this one exits with the stop's status and the run resumes from its last
    checkpoint."""
    try:
        yield
    except WaitStopped as stopped:
        if get_world_size() == 1:
            stop(*point)
        logger.warning(
            f"{' '.join(original_message(str(stopped)).split())}; with {get_world_size()} "
            "processes no checkpoint can be written here (the others are not at this step): the "
            "run resumes from its last checkpoint"
        )
        interrupted = signals.stop_signal() == signal.SIGINT
        raise Preempted(INTERRUPTED_EXIT_CODE if interrupted else PREEMPTED_EXIT_CODE) from None
