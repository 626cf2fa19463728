"""A hung run found and named. Every process of a training run watches its own steps; when none
finishes for TRAIN.HANG_TIMEOUT seconds (evaluation, checkpoints and a compiling step not
counted), every process that can still run writes its Python stack to
``OUT_DIR/hang/rankR.txt``, one line names the processes that did not reach the collective the
others wait in (a process that cannot answer, such as a stopped one, as not responding, without a
stack), and every process exits with status 1: the launcher's restart and TRAIN.AUTO_RESUME take
over from the newest checkpoint.

A side channel, because the process group cannot be used: a process stuck before a collective
takes part in no other, and its peers are blocked in the backend, waiting for it. Each process
runs a thread of its own that talks to the others through the rendezvous store the processes met
at (the NUM_PROCS launcher's, torchrun's agent's, or rank 0's under srun), over a client of its
own with a short timeout. Every HANG_CHECK_PERIOD it publishes how far its main thread got: a
counter the loop moves before each collective of a step and at each finished step. A process
whose own steps stall raises the alarm in the store; every thread that sees the alarm writes its
stack and says so; after two periods the reporter (the lowest-numbered process that answered)
reads every record: a process that did not answer is not responding; among those that did, the
ones whose counter is behind the furthest did not reach the collective. This is what torch's NCCL
watchdog does for the collectives it issued (a thread beside the training, the store to make the
other ranks dump their flight records), at the level of the training loop and on gloo too. A
store that does not answer (its host stopped) cannot hang the watchdog: the process then reports
what it knows alone.

A stop signal (SIGTERM, SIGUSR1, Ctrl-C) normally ends the loop at its next sync point with a
checkpoint (``preemption``). A main thread blocked in a collective never gets there, and Python
runs no signal handler while it is blocked in native code. The watchdog sees the signal at once
(the interpreter's wakeup file descriptor); if no step finishes within max(3 periods, 3 x the
longest step) after it, the process writes its stack and exits with the stop's status (75, 130
after Ctrl-C) without a checkpoint: the newest one resumes the run.

On CUDA with NCCL, torch's flight recorder records the collectives (``process_groups`` turns it
on before the group starts); a hang writes each process's record beside its stack.
"""

import contextlib
import datetime
import faulthandler
import json
import logging
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time

import torch

from pycls.distributed.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from pycls.distributed.process_groups import ENVIRONMENT_ERROR_KEY, store_address
from pycls.distributed.ranks import broadcast_object, get_rank, get_world_size

logger = logging.getLogger(__name__)

HANG_DIR = "hang"
HANG_EXIT_CODE = 1  # the machine's failure (pycls.errors.EXIT_ENVIRONMENT): a restart may cure it
STOP_CODES = {signal.SIGTERM: PREEMPTED_EXIT_CODE, signal.SIGUSR1: PREEMPTED_EXIT_CODE,
              signal.SIGINT: INTERRUPTED_EXIT_CODE}  # fmt: skip
# A test's hook, ``fn(where, steps)``, called in the main thread before it marks a point before a
# collective: a test blocks a process there (in Python), or stops it
BEFORE_COLLECTIVE = None


class _Off:
    """The watchdog of a run that has none: every mark costs a method call."""

    def arrive(self, where):
        pass

    def step_done(self):
        pass

    def long_step(self):
        pass

    def paused(self):
        return contextlib.nullcontext()

    def stop(self):
        pass


NO_WATCHDOG = _Off()


def start_watchdog(timeout, period, out_dir):
    """The run's watchdog, started (``NO_WATCHDOG`` when ``timeout`` is 0); every process calls
    it at the same point (the processes agree on the store keys of this attempt)."""
    if timeout <= 0:
        return NO_WATCHDOG
    token = broadcast_object(secrets.token_hex(6))  # a restarted run's keys are new ones
    watchdog = Watchdog(timeout, period, out_dir, store_address(), f"pycls/watchdog/{token}/")
    watchdog.start()
    return watchdog


class Watchdog:
    """Watches the main thread's steps from a thread of its own (see the module's docstring).
    The main thread calls ``arrive`` before each collective of a step, ``step_done`` after each
    step, ``long_step`` before a step that compiles, and runs evaluation and checkpoints inside
    ``paused()``; none of them does any I/O."""

    def __init__(self, timeout, period, out_dir, address=None, prefix="pycls/watchdog/"):
        self.timeout, self.period, self.out_dir = float(timeout), float(period), out_dir
        self.rank, self.world = get_rank(), get_world_size()
        self.address, self.prefix = address if self.world > 1 else None, prefix
        self.steps = self.progress = self._paused = 0
        self.where, self._long = "start", False
        self.last_step, self.longest_step = time.monotonic(), 0.0
        self._stop_signal = None  # (signal number, when) of a stop signal seen
        self._done, self._thread, self._store = threading.Event(), None, None
        self._pipe = self._old_wakeup = None
        self.exit = _exit

    # -- the main thread's marks ----------------------------------------------------------- #
    def arrive(self, where):
        """The main thread is about to enter a collective (``where``)."""
        if BEFORE_COLLECTIVE is not None:
            BEFORE_COLLECTIVE(where, self.steps)
        self.where = where
        self.progress += 1

    def step_done(self):
        now = time.monotonic()
        if not self._paused and not self._long:
            self.longest_step = max(self.longest_step, now - self.last_step)
        self.last_step, self._long = now, False
        self.steps += 1
        self.progress += 1
        self.where = "between steps"

    def long_step(self):
        """The next step compiles: it may take any time."""
        self._long = True

    @contextlib.contextmanager
    def paused(self):
        """Evaluation, checkpoints: no steps, as long as they take."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.last_step = time.monotonic()  # the clock starts again

    # -- starting and stopping (main thread) ---------------------------------------------- #
    def start(self):
        if self.address is not None:
            host, port = self.address
            wait = datetime.timedelta(seconds=max(2 * self.period, 5.0))
            self._store = torch.distributed.TCPStore(
                host, port, is_master=False, timeout=wait, wait_for_workers=False
            )
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        try:  # the signals' numbers, written there the moment they arrive
            self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: stop signals are not watched
            self._old_wakeup = None
        self._thread = threading.Thread(target=self._run, name="pycls-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._done.set()
        os.write(self._pipe[1], b"\0")  # wakes the thread up
        self._thread.join()
        if self._old_wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup)
        for fd in self._pipe:
            os.close(fd)

    # -- the watchdog's thread ------------------------------------------------------------ #
    def _run(self):
        while not self._done.is_set():
            self._read_signals(self.period)
            if self._done.is_set():
                return
            stalled = not self._paused and not self._long
            stalled = stalled and time.monotonic() - self.last_step > self.timeout
            try:
                alarm = self._publish_and_listen(stalled)
            except Exception as e:  # the store does not answer: a stall is then told alone
                if stalled:
                    self._alone(f"the rendezvous store at {self._where_store()} does not answer "
                                f"({type(e).__name__}): its host may be stopped too")  # fmt: skip
                alarm = False
            if stalled or alarm:
                self._hang()
            self._check_stop()

    def _read_signals(self, timeout):
        ready, _, _ = select.select([self._pipe[0]], [], [], timeout)
        if not ready:
            return
        for number in os.read(self._pipe[0], 512):
            if number in STOP_CODES and self._stop_signal is None:
                self._stop_signal = (signal.Signals(number), time.monotonic())

    def _key(self, name):
        return f"{self.prefix}{name}"

    def _record(self, dumped=False):
        return json.dumps({"progress": self.progress, "steps": self.steps, "where": self.where,
                           "pid": os.getpid(), "host": socket.gethostname(),
                           "dumped": dumped})  # fmt: skip

    def _publish_and_listen(self, stalled):
        """Publishes this process's record; raises the alarm when ``stalled``; returns whether
        the alarm is up."""
        if self._store is None:
            return False
        self._store.set(self._key(f"rank{self.rank}"), self._record())
        if stalled:
            self._store.add(self._key("alarm"), 1)
            return True
        return self._store.check([self._key("alarm")])

    def _hang(self):
        """Every process that sees the alarm: its stack to a file, its record marked; then the
        reporter names the culprits; all exit 1."""
        if self._store is None:
            self._alone("the only process")
        self._write_stack("hang")
        try:
            self._store.set(self._key(f"rank{self.rank}"), self._record(dumped=True))
            time.sleep(2 * self.period + 1.0)  # every thread that can still run sees the alarm
            records = self._records()
        except Exception as e:  # the store went away meanwhile
            self._alone(f"the rendezvous store stopped answering ({type(e).__name__})")
        answered = sorted(r for r, rec in records.items() if rec and rec["dumped"])
        if self.rank == answered[0]:
            self._report(self._hang_line(records, answered))
        else:  # the reporter's line reaches the launcher before this process's exit status
            with contextlib.suppress(Exception):
                self._store.wait([self._key("reported")], datetime.timedelta(seconds=self.period))
        self.exit(HANG_EXIT_CODE)

    def _records(self):
        keys = [self._key(f"rank{r}") for r in range(self.world)]
        return {r: json.loads(self._store.get(k)) if self._store.check([k]) else None
                for r, k in enumerate(keys)}  # fmt: skip

    def _hang_line(self, records, answered):
        furthest = max(records[r]["progress"] for r in answered)
        behind = [r for r in answered if records[r]["progress"] < furthest]
        silent = [r for r in range(self.world) if r not in answered]
        waiting = [r for r in answered if r not in behind]
        stuck = f"step {self.steps + 1} of this attempt"
        parts = []
        if behind:
            parts.append(f"rank(s) {_ranks(behind)} did not reach the collective ranks "
                         f"{_ranks(waiting)} wait in")  # fmt: skip
        if silent:
            parts.append(f"rank(s) {_ranks(silent)} not responding (stopped, or their host is "
                         "gone: no stack)")  # fmt: skip
        if not parts:
            parts.append(f"every rank waits at the same point ({records[answered[0]]['where']})")
        stacks = os.path.join(self.out_dir, HANG_DIR)
        return (f"hang: no training step finished for {self.timeout:g} s (TRAIN.HANG_TIMEOUT) at "
                f"{stuck}: {'; '.join(parts)}; the stacks of rank(s) {_ranks(answered)} are in "
                f"{stacks}; exiting with status {HANG_EXIT_CODE} (TRAIN.AUTO_RESUME resumes from "
                "the newest checkpoint)")  # fmt: skip

    def _report(self, line):
        logger.error(line)
        if self.rank != 0:  # only rank 0 logs to OUT_DIR/stdout.log
            _append(os.path.join(self.out_dir, "stdout.log"), line)
        with contextlib.suppress(Exception):  # a store that does not answer: the log has it
            if self._store is not None:
                self._store.set(ENVIRONMENT_ERROR_KEY, f"error: {line}")  # NUM_PROCS' parent's
                self._store.set(self._key("reported"), "1")

    def _alone(self, why):
        """What this process knows by itself, when it cannot hear the others."""
        stack = self._write_stack("hang")
        self._report(f"hang: no training step finished for {self.timeout:g} s "
                     f"(TRAIN.HANG_TIMEOUT) in rank {self.rank} after {self.steps} steps ({why}); "
                     f"its stack is in {stack}; exiting with status {HANG_EXIT_CODE}")  # fmt: skip
        self.exit(HANG_EXIT_CODE)

    def _check_stop(self):
        """A stop signal that the loop has not acted on: no step since it came, for longer than
        the loop could need to reach its stop."""
        if self._stop_signal is None or self._paused:
            return
        sig, since = self._stop_signal
        grace = max(3 * self.period, 3 * self.longest_step)
        if time.monotonic() - max(since, self.last_step) <= grace:
            return
        stack = self._write_stack(sig.name)
        self._stop_signal = None
        line = (f"{sig.name} came while rank {self.rank} was blocked at step {self.steps + 1} "
                f"({self.where}): no step finished in the {grace:g} s since; exiting with status "
                f"{STOP_CODES[sig]} without a checkpoint (TRAIN.AUTO_RESUME resumes from the "
                f"newest one); the stack is in {stack}")  # fmt: skip
        logger.error(line)
        if self.rank != 0:
            _append(os.path.join(self.out_dir, "stdout.log"), line)
        self.exit(STOP_CODES[sig])

    def _write_stack(self, why):
        """Every thread's Python stack (and on NCCL torch's flight record) under OUT_DIR/hang."""
        folder = os.path.join(self.out_dir, HANG_DIR)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}.txt")
        with open(path, "w") as f:
            f.write(f"rank {self.rank} of {self.world}, pid {os.getpid()} on "
                    f"{socket.gethostname()}, {why}: {self.steps} steps done, the main "
                    f"thread's last mark: {self.where}\n\n")  # fmt: skip
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        _dump_flight_record(os.path.join(folder, "flight_recorder", f"rank_{self.rank}"))
        return path

    def _where_store(self):
        return ":".join(map(str, self.address)) if self.address else "?"


def _ranks(ranks):
    return ", ".join(map(str, ranks)) or "none"


def _append(path, line):
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def _dump_flight_record(path):
    """torch's NCCL flight record of this process's collectives (a pickle, for torch's
    ``fr_trace`` analyser), where NCCL recorded one."""
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None or int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) <= 0:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(Exception), open(path, "wb") as f:
        f.write(dump())


def _exit(code):
    """Ends the process from the watchdog's thread (the main thread is blocked): logs flushed."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
