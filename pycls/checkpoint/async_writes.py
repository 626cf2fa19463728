"""Checkpoints written while training goes on: the state is copied to host memory (staged), and
a background thread writes, checksums, seals and renames it, so the loop waits only for the copy.

- ``stage(obj)``: ``obj`` with every tensor copied to host memory (CUDA tensors into pinned
  memory, one synchronisation for all), so that the training may change the originals at once;
  ``Writer.stage`` copies into the buffers of the previous save, which no write reads any more.
- ``Writer``: at most one write in flight. ``submit`` starts one (waiting for the previous one
  first), ``then`` chains a step after the write in flight (a step runs only if every step
  before it succeeded: model_best.pyth never holds an epoch no checkpoint holds), ``wait``
  returns once it is whole (or failed) and hands back its error.

The guarantees are those of a synchronous write, because the same functions do the writing (a
temporary name, fsync, the checksum or the folder's manifest, then the rename): a checkpoint is
visible under its name only when whole and verified, and a write that fails or is killed
leaves the earlier checkpoints as they were.

``fault_point(stage, path)`` marks the points between a write's stages, synchronous or not
(``STAGES``); a test sets ``FAULT_HOOKS[stage]`` to a function of the path to fail or stop the
write there.
"""

import logging
import threading
import time

import torch

logger = logging.getLogger(__name__)

# The points between a checkpoint write's stages, in order: the state copied to host memory
# (nothing written yet); data partly written; every data file written, the folder not yet sealed
# with its manifest; the file or folder whole under its temporary name, not yet renamed
STAGES = ("staged", "mid_write", "before_manifest", "before_rename")
FAULT_HOOKS = {}


def fault_point(stage, path):
    """Runs the test hook set for ``stage`` (see ``STAGES``), if any, with the checkpoint's
    path."""
    hook = FAULT_HOOKS.get(stage)
    if hook is not None:
        hook(path)


def stage(obj, previous=None):
    """``obj`` (dicts, lists and tuples of tensors and plain values) with every tensor copied to
    host memory: into ``previous``'s tensor where it has the same place, shape and dtype (a
    staged copy no write reads any more), else into new memory (pinned for a CUDA tensor)."""
    on_cuda = []
    staged = _copy(obj, previous, on_cuda)
    if on_cuda:
        torch.cuda.synchronize()  # the non-blocking copies from the device are done
    return staged


def _copy(obj, previous, on_cuda):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        fits = isinstance(previous, torch.Tensor) and previous is not obj
        fits = fits and previous.shape == t.shape and previous.dtype == t.dtype
        host = previous if fits else torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        if t.is_cuda:
            on_cuda.append(t)
        return host.copy_(t, non_blocking=t.is_cuda)
    if isinstance(obj, dict):
        previous = previous if isinstance(previous, dict) else {}
        return {k: _copy(v, previous.get(k), on_cuda) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        previous = previous if isinstance(previous, (list, tuple)) else ()
        olds = list(previous) + [None] * (len(obj) - len(previous))
        return type(obj)(_copy(v, old, on_cuda) for v, old in zip(obj, olds))
    return obj


class _Write:
    """One write in flight: its steps, run in order by one thread."""

    def __init__(self, path, steps):
        self.path, self.steps, self.error, self.finished = path, list(steps), None, False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="pycls-checkpoint-writer")
        self.thread.daemon = True  # the trainer waits for it; a dying interpreter need not

    def _run(self):
        while True:
            with self.lock:
                if not self.steps or self.error is not None:
                    self.finished = True
                    return
                step = self.steps.pop(0)
            try:
                step()
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                self.error = e

    def add(self, step):
        """Appends ``step``; False when the write has already finished."""
        with self.lock:
            if self.finished:
                return False
            self.steps.append(step)
            return True


class Writer:
    """At most one checkpoint write in flight, in a background thread. ``group``: the process
    group DCP coordinates its background writes over (one apart from the training's, whose
    collectives the main thread goes on calling meanwhile); None in one process."""

    def __init__(self, group=None):
        self.group, self._write = group, None
        self.staged = {}  # the last host copy of each kind of state, reused while no write runs

    def stage(self, obj, kind):
        """``obj`` copied to host memory, into the last copy of its ``kind`` when no write is in
        flight (none then reads it): a save after the first allocates nothing."""
        staged = stage(obj, self.staged.get(kind) if self._write is None else None)
        self.staged[kind] = staged
        return staged

    @property
    def in_flight(self):
        """The path of the write not yet waited for, or None."""
        return self._write.path if self._write is not None else None

    def submit(self, path, *steps):
        """Writes ``path`` by running ``steps`` in the background, after the write in flight (if
        any) is whole; raises that one's error instead, if it failed."""
        error = self.wait()
        if error is not None:
            raise error
        self._write = _Write(path, steps)
        self._write.thread.start()

    def then(self, path, step):
        """Runs ``step`` after the write in flight if that succeeds (a failed one keeps its error
        for ``wait``); with none in flight, as a write of its own."""
        write = self._write
        if write is not None and (write.add(step) or write.error is not None):
            return
        self.submit(path, step)

    def wait(self):
        """Blocks until the write in flight (if any) has finished, saying so in the log if it had
        not; returns its error (None if it succeeded or there was none)."""
        write, self._write = self._write, None
        if write is None:
            return None
        if write.thread.is_alive():
            logger.info(f"waiting for the checkpoint write in flight ({write.path})")
            start = time.perf_counter()
            write.thread.join()
            logger.info(f"waited {time.perf_counter() - start:.2f} s for {write.path}")
        write.thread.join()
        return write.error
