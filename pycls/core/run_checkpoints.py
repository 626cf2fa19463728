"""The files a training run writes to resume from and to hand on: the checkpoint after an epoch
or at a stop, ``model_best.pyth`` after the best evaluation, ``model_final.safetensors`` at the
end. Every process calls each of them (sharded engines write their part, FSDP and the pipeline
gather the whole model for the others; rank 0 writes the single files).

What a checkpoint records of the trainer besides the engine's state is
``pycls.core.resume_point.checkpoint_extra``; the files' formats are ``pycls.checkpoint``'s.
"""

import contextlib

from pycls import distributed as dist
from pycls.checkpoint import resume, single_file, weight_files
from pycls.core import logging as logs

logger = logs.get_logger(__name__)


class RunCheckpoints:
    """The checkpoints of one run in ``cfg.OUT_DIR``, of the engine's model, optimizer and
    scaler."""

    def __init__(self, cfg, engine, optimizer, scaler):
        self.cfg, self.engine, self.optimizer, self.scaler = cfg, engine, optimizer, scaler
        self.last_saved = None  # (epoch, it) of the newest checkpoint written

    def save(self, epoch, it, extra):
        """The checkpoint after ``epoch`` epochs (+ ``it`` steps of the next when preempted),
        with the trainer's ``extra`` state; older ones beyond TRAIN.KEEP_CHECKPOINTS go once it
        is whole. Returns its path on rank 0."""
        cfg = self.cfg
        path = self.engine.save(cfg.OUT_DIR, epoch, it, optimizer=self.optimizer,
                                scaler=self.scaler, cfg_yaml=cfg.dump(), extra=extra)  # fmt: skip
        self.last_saved = (epoch, it)
        if path:
            logger.info(f"wrote checkpoint {path}")
        if dist.is_main_proc():  # written whole (every process's part): older ones may go
            resume.prune_checkpoints(cfg.OUT_DIR, cfg.TRAIN.KEEP_CHECKPOINTS)
        return path

    def save_best(self, best, classes, ema):
        """OUT_DIR/checkpoints/model_best.pyth: the weights ``best`` names (raw or ``ema``'s),
        with the train classes."""
        kind, module = best["weights"], self.engine.module
        swap = ema.swapped_into(module) if kind == "ema" else contextlib.nullcontext()
        with swap:  # the whole model's weights, gathered from all processes under FSDP/pipeline
            weights = self.engine.full_state_dict()
        if not dist.is_main_proc():
            return
        single_file.save_file(
            {"epoch": best["epoch"], "model_state": weights, "cfg": self.cfg.dump(), **best}
            | {"classes": classes},
            single_file.get_best_checkpoint_path(self.cfg.OUT_DIR),
        )

    def save_final_weights(self):
        """OUT_DIR/model_final.safetensors: the model's weights only, pycls naming, the config as
        metadata."""
        state = self.engine.full_state_dict()
        if dist.is_main_proc():
            path = weight_files.final_weights_path(self.cfg.OUT_DIR)
            weight_files.save_safetensors(state, path, {"naming": "pycls", "cfg": self.cfg.dump()})
            logger.info(f"wrote {path}")
