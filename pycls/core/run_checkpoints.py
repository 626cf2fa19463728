"""The files a training run writes to resume from and to hand on: the checkpoint after an epoch
or at a stop, ``model_best.pyth`` after the best evaluation, ``model_final.safetensors`` at the
end. Every process calls each of them (sharded engines write their part, FSDP and the pipeline
gather the whole model for the others; rank 0 writes the single files).

With TRAIN.ASYNC_CHECKPOINT the checkpoint and model_best.pyth are staged in host memory and
written in the background (``pycls.checkpoint.async_writes``): the loop waits for the copy
only. ``wait`` is where every process learns that the write in flight is whole (or failed: then
all of them raise); the next save, a stop and the end of the run call it, and ``close`` on the
way out of an error waits for the write too.

What a checkpoint records of the trainer besides the engine's state is
``pycls.core.resume_point.checkpoint_extra``; the files' formats are ``pycls.checkpoint``'s.
"""

import contextlib
import time

from pycls import distributed as dist
from pycls.checkpoint import async_writes, resume, single_file, weight_files
from pycls.checkpoint.files import CheckpointWriteError
from pycls.core import logging as logs
from pycls.optim.library_optimizers import evaluation_weights

logger = logs.get_logger(__name__)


class RunCheckpoints:
    """The checkpoints of one run in ``cfg.OUT_DIR``, of the engine's model, optimizer and
    scaler."""

    def __init__(self, cfg, engine, optimizer, scaler):
        self.cfg, self.engine, self.optimizer, self.scaler = cfg, engine, optimizer, scaler
        self.last_saved = None  # (epoch, it) of the newest checkpoint saved (or being written)
        self.writer = None
        if cfg.TRAIN.ASYNC_CHECKPOINT:  # every process creates the writer's group here
            self.writer = async_writes.Writer(dist.side_group())

    def save(self, epoch, it, extra):
        """The checkpoint after ``epoch`` epochs (+ ``it`` steps of the next when preempted),
        with the trainer's ``extra`` state; older ones beyond TRAIN.KEEP_CHECKPOINTS go once it
        is whole. Returns its path on rank 0."""
        start, cfg = time.perf_counter(), self.cfg
        self.wait()  # at most one write in flight
        # The model's weights to keep (Schedule-Free's average; its training weights are in the
        # optimizer's state), staged or written before the training weights come back
        with evaluation_weights(self.optimizer):
            path = self.engine.save(cfg.OUT_DIR, epoch, it, optimizer=self.optimizer,
                                    scaler=self.scaler, cfg_yaml=cfg.dump(), extra=extra,
                                    writer=self.writer)  # fmt: skip
        self.last_saved = (epoch, it)
        if self.writer is None:
            self._written(path)
        elif dist.is_main_proc():
            stall = f"the loop waited {time.perf_counter() - start:.2f} s"
            logger.info(f"writing checkpoint {path} in the background ({stall})")
            self.writer.then(path, lambda: self._written(path))
        return path

    def _written(self, path):
        if path:
            logger.info(f"wrote checkpoint {path}")
        if dist.is_main_proc():  # written whole (every process's part): older ones may go
            resume.prune_checkpoints(self.cfg.OUT_DIR, self.cfg.TRAIN.KEEP_CHECKPOINTS)

    def wait(self):
        """Returns once the write in flight is whole in every process; if it failed in any, every
        process raises (a collective: every process calls it at the same point)."""
        if self.writer is None:
            return
        path, error = self.writer.in_flight, self.writer.wait()
        if self.engine.any(error is not None):
            raise error or CheckpointWriteError(
                f"cannot write {path}: another process failed to write its part (its log says why)"
            )

    def close(self):
        """On the way out of an error: the write in flight finished (a failed one has removed
        what it wrote), its own error logged, not raised over the first."""
        error = self.writer.wait() if self.writer is not None else None
        if error is not None:
            logger.error(f"the checkpoint write in flight failed too: {error}")

    def save_best(self, best, classes, ema):
        """OUT_DIR/checkpoints/model_best.pyth: the weights ``best`` names (raw or ``ema``'s),
        with the train classes; written after the checkpoint in flight, only if that succeeds."""
        kind, module = best["weights"], self.engine.module
        swap = ema.swapped_into(module) if kind == "ema" else contextlib.nullcontext()
        with evaluation_weights(self.optimizer), swap:  # the whole model's, gathered
            weights = _held(self.engine.full_state_dict())
        if not dist.is_main_proc():
            return
        state = {"epoch": best["epoch"], "model_state": weights, "cfg": self.cfg.dump(), **best}
        state["classes"] = classes
        path = single_file.get_best_checkpoint_path(self.cfg.OUT_DIR)
        if self.writer is None:
            single_file.save_file(state, path)
            return
        staged = self.writer.stage(state, "best")
        self.writer.then(path, lambda: single_file.write_file(staged, path))

    def save_final_weights(self):
        """OUT_DIR/model_final.safetensors: the model's weights only, pycls naming, the config as
        metadata."""
        with evaluation_weights(self.optimizer):
            state = _held(self.engine.full_state_dict())
        if dist.is_main_proc():
            path = weight_files.final_weights_path(self.cfg.OUT_DIR)
            weight_files.save_safetensors(state, path, {"naming": "pycls", "cfg": self.cfg.dump()})
            logger.info(f"wrote {path}")


def _held(state):
    """The tensors of a state dict copied: an engine's state dict may hold the parameters
    themselves, which get their training weights back (in place) when the block that swapped in
    the weights to keep ends."""
    return {k: v.detach().clone() for k, v in state.items()}
