"""How pycls measures time: every timing of ``--mode time`` and of the scripts in benchmarks/.

- ``time_calls``: a callable timed after untimed warm-up calls, the device synchronised at both
  ends of each timed sample; the ``Timing`` it returns holds the samples and their median,
  quartiles, interquartile range and minimum.
- ``run_pinned``: one measurement in a fresh Python process pinned to a number of intra-op
  threads (a cold start, no state left over from another contender).
- ``alternate``: contenders take turns, round by round, so that a change in the machine's load
  falls on all of them alike; the ``Rounds`` it returns gives each contender's timing and the
  ratios between contenders (per round, and of the pooled medians).
- ``matmul_tflops``: the achieved TFLOP/s of a square matrix product, the practical ceiling that
  MFU is compared with where no datasheet peak is known.
- ``source_revision`` and ``load_average``: what a table of measured numbers cites.
- ``Deadline``: a time limit a long measurement checks between its parts (a script that skips
  what is left rather than be stopped mid-way).

This module imports nothing from pycls (the standard library and torch only): a benchmark worker
whose own ``pycls`` is another code base (upstream's) loads it by its path.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Mapping

import torch


def sync(device):
    """Waits for the work queued on ``device`` (a torch.device, a name like "cuda:0", or None
    for the host): asynchronous CUDA kernels have not run when their call returns."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def quartiles(values):
    """(first quartile, median, third quartile) of a list of numbers (inclusive method: the
    quartiles of two values lie between them); a single value is all three."""
    values = list(values)
    if not values:
        raise ValueError("quartiles of no values")
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


class _Quartiles:
    """``median``, ``q1`` and ``q3`` of the values ``_values()`` returns."""

    def _values(self):
        raise NotImplementedError

    @property
    def quartiles(self):
        return quartiles(self._values())

    @property
    def median(self):
        return self.quartiles[1]

    @property
    def q1(self):
        return self.quartiles[0]

    @property
    def q3(self):
        return self.quartiles[2]


@dataclasses.dataclass(frozen=True)
class Timing(_Quartiles):
    """Seconds per call, one value per timed sample (a sample of ``calls_per_sample``
    back-to-back calls is divided by their number)."""

    times: tuple
    calls_per_sample: int = 1

    def _values(self):
        return self.times

    @property
    def iqr(self):
        """The interquartile range: the spread of the middle half of the samples."""
        q1, _, q3 = self.quartiles
        return q3 - q1

    @property
    def min(self):
        """The fastest sample: on a busy machine other processes only ever slow a call down."""
        return min(self.times)

    @property
    def max(self):
        return max(self.times)


class Stopwatch:
    """Wall seconds and CPU seconds since it was made. The CPU clock is this thread's by default:
    what one call held its caller for, where the work it starts goes on in other threads (a
    checkpoint written in the background: ``benchmarks/checkpoint_stall.py``); with
    ``whole_process``, every thread's (a loader whose reads are served by a thread of the same
    process: ``benchmarks/loader_speed.py``)."""

    def __init__(self, whole_process=False):
        self._clock = time.process_time if whole_process else time.thread_time
        self._wall, self._cpu = time.perf_counter(), self._clock()

    def wall(self):
        return time.perf_counter() - self._wall

    def cpu(self):
        return self._clock() - self._cpu


def warm_up(fn, calls):
    """Calls ``fn`` ``calls`` times, untimed (compilation, caches, allocator, cuDNN choices)."""
    for _ in range(calls):
        fn()


def time_calls(fn, device=None, warmup=0, iters=1, *, group=1, clock=None):
    """Times ``iters`` samples of ``group`` back-to-back calls of ``fn``, after ``warmup``
    untimed calls, and returns their ``Timing`` in seconds per call.

    The device is synchronised before each sample starts and after it ends, so a sample holds
    all the work its calls queued and none of the work queued before it. Within a sample nothing
    synchronises: ``group`` > 1 measures throughput with the host running ahead of the device, as
    it does in training. ``clock`` is a function returning seconds (``time.perf_counter``, the
    wall clock, by default; ``time.process_time`` counts this process's CPU time only, which
    other processes' preemption does not inflate, but it adds up the threads and misses work
    done by other processes, such as compiler workers)."""
    if iters < 1 or group < 1:
        raise ValueError(f"time_calls needs iters >= 1 and group >= 1, got {iters} and {group}")
    clock = clock or time.perf_counter
    warm_up(fn, warmup)
    times = []
    for _ in range(iters):
        sync(device)
        start = clock()
        for _ in range(group):
            fn()
        sync(device)
        times.append((clock() - start) / group)
    return Timing(tuple(times), group)


def matmul_tflops(device, dtype, n=None, warmup=None, iters=None):
    """Achieved TFLOP/s (2 n^3 per product) of an n x n x n matrix product in ``dtype`` on random
    data: on a GPU the median of 10 products at 8192^2 after 3 warm-up ones, on a CPU the fastest
    of 5 at 2048^2 after 2 (a busy machine only slows products down); ``n``, ``warmup`` and
    ``iters`` override the sizes."""
    device = torch.device(device)
    cpu = device.type == "cpu"
    n = n or (2048 if cpu else 8192)
    warmup = (2 if cpu else 3) if warmup is None else warmup
    iters = iters or (5 if cpu else 10)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timing = time_calls(lambda: torch.mm(a, b), device, warmup, iters)
    seconds = timing.min if cpu else timing.median
    return 2 * n**3 / seconds / 1e12


# ------------------------------------------------------------------------------------------------ #
# One measurement per process
# ------------------------------------------------------------------------------------------------ #


def pinned_env(threads, extra_env=None):
    """The environment of a process pinned to ``threads`` intra-op threads (torch reads the
    OpenMP and MKL variables at start-up), with ``extra_env`` added."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra_env or {})
    return env


def run_pinned(script, job, threads, extra_env=None):
    """Runs ``python script --worker JSON(job)`` in a fresh process pinned to ``threads`` threads,
    from the folder above the script's (the repository root for benchmarks/), and returns the
    JSON its last line of output prints. A failing worker raises RuntimeError with the end of
    its error output."""
    cmd = [sys.executable, os.path.abspath(script), "--worker", json.dumps(job)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=pinned_env(threads, extra_env), cwd=root
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{os.path.basename(script)} worker {job} failed (exit status {proc.returncode}):\n"
            + proc.stderr[-3000:]
        )
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------------------ #
# Contenders taking turns
# ------------------------------------------------------------------------------------------------ #


def seconds_of(result):
    """The timed samples (seconds) of one contender's result in one round: a number, a list of
    numbers, a Timing, or a dict holding them under "times"."""
    if isinstance(result, Timing):
        return list(result.times)
    if isinstance(result, Mapping):
        return seconds_of(result["times"])
    if isinstance(result, (int, float)):
        return [float(result)]
    return [float(t) for t in result]


@dataclasses.dataclass(frozen=True)
class Ratio(_Quartiles):
    """How contender a's times compare with b's: ``of_medians`` is the median of all of a's
    samples over the median of all of b's; ``per_round`` the ratio of the two medians in each
    round, measured under the same load, whose median and quartiles say how sure the comparison
    is."""

    of_medians: float
    per_round: tuple

    def _values(self):
        return self.per_round


def ratio(a_rounds, b_rounds):
    """The Ratio of a's times to b's, each given as one list of seconds per round."""
    if len(a_rounds) != len(b_rounds) or not a_rounds:
        raise ValueError(f"ratio of {len(a_rounds)} rounds to {len(b_rounds)}")
    pooled_a = [t for r in a_rounds for t in r]
    pooled_b = [t for r in b_rounds for t in r]
    per_round = tuple(
        statistics.median(a) / statistics.median(b) for a, b in zip(a_rounds, b_rounds)
    )
    return Ratio(statistics.median(pooled_a) / statistics.median(pooled_b), per_round)


@dataclasses.dataclass(frozen=True)
class Rounds:
    """What ``alternate`` measured: each contender's result in every round, and the machine's
    load average before each round (None where the platform has none)."""

    results: dict
    loads: list

    def times(self, name):
        """One list of seconds per round."""
        return [seconds_of(r) for r in self.results[name]]

    def timing(self, name):
        """The Timing of all of a contender's samples, every round pooled."""
        return Timing(tuple(t for r in self.times(name) for t in r))

    def round_medians(self, name):
        return [statistics.median(r) for r in self.times(name)]

    def ratio(self, name, reference):
        """``name``'s times over ``reference``'s."""
        return ratio(self.times(name), self.times(reference))

    def load_range(self):
        """The range of the load averages ("2.10-3.45"), or "unknown"."""
        known = [x for x in self.loads if x is not None]
        return f"{min(known):.2f}-{max(known):.2f}" if known else "unknown"


def alternate(
    contenders: Mapping[Hashable, Callable],
    rounds: int,
    *,
    rotate: bool = True,
    log: Callable | None = print,
    describe: Callable | None = None,
):
    """Runs every contender (a callable measuring once) once per round, for ``rounds`` rounds,
    and returns the Rounds. Taking turns puts each contender's measurements under the load of
    the same minutes as the others'; with ``rotate`` the order also shifts by one every round,
    so that none always runs first (after a pause) or last. ``log`` (print by default; None:
    silent) receives one line per round with the load average and, with ``describe`` (a result
    -> text function), one line per measurement."""
    names = list(contenders)
    results = {name: [] for name in names}
    loads = []
    for index in range(rounds):
        load = load_average()
        loads.append(load)
        if log:
            shown = "unknown" if load is None else f"{load:.2f}"
            log(f"round {index + 1}/{rounds}: load average {shown}")
        shift = index % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            result = contenders[name]()
            results[name].append(result)
            if log and describe:
                log(f"  {name}: {describe(result)}")
    return Rounds(results, loads)


# ------------------------------------------------------------------------------------------------ #
# What a table of numbers cites
# ------------------------------------------------------------------------------------------------ #


def load_average():
    """The machine's load average over the last minute, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def source_revision():
    """The short git revision of this checkout, "+dirty" when a tracked file differs from it;
    "unknown" outside a git checkout (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = dict(cwd=root, capture_output=True, text=True)
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, **run).stdout.strip()
    except OSError:
        return "unknown"
    return (rev + ("+dirty" if dirty else "")) if rev else "unknown"


class Deadline:
    """A time limit counted from its creation (``seconds`` None: no limit)."""

    def __init__(self, seconds=None):
        self.seconds, self._start = seconds, time.monotonic()

    def elapsed(self):
        return time.monotonic() - self._start

    def left(self):
        """Seconds left (infinite without a limit; negative once it has passed)."""
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def passed(self, margin=0.0):
        """Whether less than ``margin`` seconds are left."""
        return self.left() <= margin
