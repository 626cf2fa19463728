"""Training and evaluation loops: train_model, test_model.

One iteration: batch to device (normalised there) -> forward under the AMP level's autocast ->
loss -> scaled backward -> optional clipping -> foreach optimizer step -> device-side meters. The
learning rate is set every iteration from the schedule (host arithmetic only). The host waits for
the device only every LOG_PERIOD iterations, when the meters are synchronised and logged.
"""

import math
import os
import random
import sys
import time

import numpy as np
import torch

from pycls.core import builders, checkpoint, config, meters
from pycls.core import distributed as dist
from pycls.core import logging as logs
from pycls.core.optimizer import construct_optimizer
from pycls.core.precision import precision_from_cfg
from pycls.core.schedules import lr_schedule_from_cfg, set_lr

logger = logs.get_logger(__name__)


# ------------------------------------------------------------------------------------------------ #
# Set-up
# ------------------------------------------------------------------------------------------------ #


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_env(cfg):
    """Output folder, resolved config, logging, seeds and backend flags; returns the device."""
    if dist.is_main_proc():
        os.makedirs(cfg.OUT_DIR, exist_ok=True)
        config.dump_cfg(cfg)
    logs.setup_logging(cfg.OUT_DIR)
    device = dist.resolve_device(cfg.DEVICE)
    logger.info(
        f"pycls on {device}, torch {torch.__version__}, {dist.get_world_size()} process(es)"
    )
    logger.info(f"config:\n{cfg.dump()}")
    seed_everything(cfg.RNG_SEED + dist.get_rank())
    # TF32 matmuls on Ampere+ (fp32 runs); cudnn autotuning unless bitwise repeatability is asked
    torch.backends.cuda.matmul.allow_tf32 = not cfg.DETERMINISTIC
    torch.backends.cudnn.allow_tf32 = not cfg.DETERMINISTIC
    torch.backends.cudnn.benchmark = not cfg.DETERMINISTIC
    torch.backends.cudnn.deterministic = cfg.DETERMINISTIC
    return device


def log_complexity(cfg, model):
    cx = model.complexity(cfg.TRAIN.IM_SIZE)
    logs.log_json_stats({"_type": "complexity", "im_size": cfg.TRAIN.IM_SIZE, **cx})
    return cx


def build_training(cfg, device):
    """Model (on device, cast for the AMP level, parallelised), optimizer, scaler, loss."""
    from pycls.core.parallel import parallelize

    model = builders.build_model(cfg)
    log_complexity(cfg, model)
    precision = precision_from_cfg(cfg, device)
    model = precision.prepare_model(model.to(device))
    model = parallelize(model, cfg, device)
    optimizer = construct_optimizer(
        cfg, checkpoint.unwrap_model(model), master_weights=precision.master_weights
    )
    scaler = precision.make_scaler(device)
    loss_fn = builders.build_loss_fn(cfg).to(device)
    return model, optimizer, scaler, loss_fn, precision


def maybe_compile(cfg, model):
    return torch.compile(model) if cfg.TRAIN.COMPILE else model


# ------------------------------------------------------------------------------------------------ #
# Loops
# ------------------------------------------------------------------------------------------------ #


def _progress(total, desc):
    """A tqdm bar on an interactive terminal (main process only), else None."""
    if not (dist.is_main_proc() and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def train_step(model, optimizer, scaler, loss_fn, precision, images, labels, clip_grad=0.0):
    """One optimisation step; returns the detached loss and logits (no host sync)."""
    with precision.autocast():
        logits = model(precision.cast_input(images))
    loss = loss_fn(logits.float(), labels)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if clip_grad > 0:
        scaler.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, clip_grad, foreach=True)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach(), logits.detach()


class Evaluator:
    """Evaluation on the test split: loss, top-1/top-5 error, best top-1 error so far."""

    def __init__(self, cfg, device, precision, loss_fn):
        self.cfg, self.device, self.precision, self.loss_fn = cfg, device, precision, loss_fn
        self.test_loader = builders.build_loader(cfg, train=False)
        self.test_batches = builders.device_batches(cfg, self.test_loader, device, train=False)
        self.min_top1_err = float("inf")

    @torch.no_grad()
    def run(self, model, epoch):
        self.test_loader.sampler.set_epoch(epoch)
        model.eval()
        meter = meters.Meter(len(self.test_loader), self.device)
        for images, labels, num_skipped in self.test_batches:
            if labels.numel() == 0:
                meter.add_skipped(num_skipped)
                continue
            with self.precision.autocast():
                logits = model(self.precision.cast_input(images))
            loss = self.loss_fn(logits.float(), labels)
            meter.update(loss, logits, labels, num_skipped)
        meter.sync()
        stats = meter.epoch_stats()
        self.min_top1_err = min(self.min_top1_err, stats["top1_err"])
        stats.update(
            _type="test_epoch",
            epoch=f"{epoch + 1}/{self.cfg.OPTIM.MAX_EPOCH}",
            epoch_num=epoch + 1,
            min_top1_err=self.min_top1_err,
            time_epoch=time.perf_counter() - meter.epoch_start,
            im_size=self.test_loader.sampler.image_size,
            mem=meters.gpu_mem_usage_mb(),
        )
        logs.log_json_stats(stats)
        return stats


class Trainer:
    """Holds what the loops share; the loops themselves are train_epoch and test_epoch."""

    def __init__(self, cfg, device):
        self.cfg, self.device = cfg, device
        (self.model, self.optimizer, self.scaler, self.loss_fn, self.precision) = build_training(
            cfg, device
        )
        self.train_loader = builders.build_loader(cfg, train=True)
        self.train_batches = builders.device_batches(cfg, self.train_loader, device, train=True)
        self.evaluator = Evaluator(cfg, device, self.precision, self.loss_fn)
        if len(self.train_loader) == 0:
            raise ValueError(
                f"TRAIN.BATCH_SIZE: {cfg.TRAIN.BATCH_SIZE} exceeds the "
                f"{len(self.train_loader.dataset)} training images (no full batch to train on)"
            )
        self.schedule = lr_schedule_from_cfg(cfg)
        self.start_epoch = 0
        self.step_model = self.model  # compiled after a resume has loaded the plain module

    # -- checkpoints ------------------------------------------------------------------------ #
    def resume_or_init(self):
        cfg = self.cfg
        last = checkpoint.get_last_checkpoint(cfg.OUT_DIR) if cfg.TRAIN.AUTO_RESUME else None
        if last:
            state = checkpoint.load_checkpoint(
                last, model=self.model, optimizer=self.optimizer, scaler=self.scaler
            )
            self.start_epoch = state["epoch"]
            self.evaluator.min_top1_err = state.get("min_top1_err", float("inf"))
            logger.info(f"resumed from {last} (epoch {self.start_epoch})")
        elif cfg.TRAIN.WEIGHTS:
            checkpoint.load_model_weights(cfg.TRAIN.WEIGHTS, self.model)
            logger.info(f"initialised weights from {cfg.TRAIN.WEIGHTS}")
        self.step_model = maybe_compile(cfg, self.model)

    def save(self, epoch):
        if not dist.is_main_proc():
            return None
        path = checkpoint.save_checkpoint(
            self.cfg.OUT_DIR,
            epoch,
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            cfg_yaml=self.cfg.dump(),
            extra={"min_top1_err": self.evaluator.min_top1_err},
        )
        logger.info(f"wrote checkpoint {path}")
        return path

    # -- one training iteration ------------------------------------------------------------- #
    def train_step(self, images, labels):
        return train_step(
            self.step_model,
            self.optimizer,
            self.scaler,
            self.loss_fn,
            self.precision,
            images,
            labels,
            clip_grad=self.cfg.OPTIM.CLIP_GRAD,
        )

    def train_epoch(self, epoch):
        cfg, n_iters = self.cfg, len(self.train_loader)
        self.train_loader.sampler.set_epoch(epoch)
        self.model.train()
        meter = meters.Meter(n_iters, self.device)
        bar = _progress(n_iters, f"epoch {epoch + 1}/{cfg.OPTIM.MAX_EPOCH}")
        skipped_before = self.scaler.skipped_steps
        lr = self.schedule(epoch)
        for it, (images, labels, num_skipped) in enumerate(self.train_batches):
            if labels.numel() == 0:  # every image of the batch was corrupt and skipped
                meter.add_skipped(num_skipped)
                continue
            lr = self.schedule(epoch + it / n_iters)
            set_lr(self.optimizer, lr)
            loss, logits = self.train_step(images, labels)
            meter.update(loss, logits, labels, num_skipped)
            if bar is not None:
                bar.update(1)
            if (it + 1) % cfg.LOG_PERIOD == 0 or it + 1 == n_iters:
                stats = meter.sync()
                self._check_finite(stats, epoch, it, skipped_before)
                self._log_iter(stats, meter, epoch, it, lr, bar)
        if bar is not None:
            bar.close()
        meter.sync()
        stats = meter.epoch_stats()
        self._check_finite(stats, epoch, n_iters - 1, skipped_before)
        stats.update(
            _type="train_epoch",
            epoch=f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
            epoch_num=epoch + 1,
            lr=lr,
            time_epoch=time.perf_counter() - meter.epoch_start,
            im_size=self.train_loader.sampler.image_size,
            batch_size=cfg.TRAIN.BATCH_SIZE,
            skipped_steps=self.scaler.skipped_steps - skipped_before,
            mem=meters.gpu_mem_usage_mb(),
        )
        logs.log_json_stats(stats)
        return stats

    def _check_finite(self, stats, epoch, it, skipped_before):
        if math.isfinite(stats["loss"]):
            return
        # Under float16 an overflowing step is skipped by the loss scaler, not fatal
        if self.precision.uses_loss_scaling and self.scaler.skipped_steps > skipped_before:
            return
        cfg = self.cfg
        raise FloatingPointError(
            f"loss is {stats['loss']} at epoch {epoch + 1}, iteration {it + 1} "
            f"(AMP.LEVEL={cfg.AMP.LEVEL}, AMP.DTYPE={cfg.AMP.DTYPE}, OPTIM.BASE_LR="
            f"{cfg.OPTIM.BASE_LR}); stopping without writing a checkpoint for this epoch. "
            "Try a lower OPTIM.BASE_LR, longer OPTIM.WARMUP_EPOCHS, OPTIM.CLIP_GRAD or AMP.LEVEL O1"
        )

    def _log_iter(self, stats, meter, epoch, it, lr, bar):
        cfg, n_iters = self.cfg, len(self.train_loader)
        remaining = (cfg.OPTIM.MAX_EPOCH - epoch) * n_iters - (it + 1)
        stats.update(
            _type="train_iter",
            epoch=f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
            iter=f"{it + 1}/{n_iters}",
            time_avg=meter.iter_time,
            eta=meters.eta_str(meter.iter_time * remaining),
            lr=lr,
            mem=meters.gpu_mem_usage_mb(),
        )
        if bar is not None:
            bar.set_postfix(loss=f"{stats['loss']:.3f}", err=f"{stats['top1_err']:.1f}")
            bar.clear()
        logs.log_json_stats(stats)

    def test_epoch(self, epoch):
        return self.evaluator.run(self.step_model, epoch)

    # -- the run ---------------------------------------------------------------------------- #
    def fit(self):
        cfg = self.cfg
        max_epoch = cfg.OPTIM.MAX_EPOCH
        test_stats = None
        if self.start_epoch >= max_epoch:
            logger.info(f"nothing to train: the checkpoint is at epoch {self.start_epoch}")
            return self.test_epoch(max_epoch - 1)
        for epoch in range(self.start_epoch, max_epoch):
            self.train_epoch(epoch)
            last = epoch + 1 == max_epoch
            if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or last:
                test_stats = self.test_epoch(epoch)
            if (epoch + 1) % cfg.TRAIN.CHECKPOINT_PERIOD == 0 or last:
                self.save(epoch + 1)
        return test_stats


def train_model(cfg):
    """Trains the model cfg describes; returns the last test_epoch stats."""
    device = setup_env(cfg)
    trainer = Trainer(cfg, device)
    trainer.resume_or_init()
    test_stats = trainer.fit()
    if dist.is_main_proc():
        log_file = os.path.join(cfg.OUT_DIR, logs.LOG_FILE)
        png = logs.plot_training_curves(log_file, os.path.join(cfg.OUT_DIR, "training_curves.png"))
        if png:
            logger.info(f"wrote {png}")
    return test_stats


def test_model(cfg):
    """Evaluates TEST.WEIGHTS on the test set; returns the test_epoch stats."""
    device = setup_env(cfg)
    if not cfg.TEST.WEIGHTS:
        raise ValueError("TEST.WEIGHTS: --mode test needs the path of a checkpoint to evaluate")
    model = builders.build_model(cfg, image_size=cfg.TEST.IM_SIZE)
    log_complexity(cfg, model)
    checkpoint.load_model_weights(cfg.TEST.WEIGHTS, model)
    precision = precision_from_cfg(cfg, device)
    model = maybe_compile(cfg, precision.prepare_model(model.to(device)))
    evaluator = Evaluator(cfg, device, precision, builders.build_loss_fn(cfg).to(device))
    return evaluator.run(model, cfg.OPTIM.MAX_EPOCH - 1)
