"""Training and evaluation loops: train_model, test_model. Where a run resumes is decided in
``pycls.core.resume_point``, what it writes in ``pycls.core.run_checkpoints``.

Every optimizer step is the one training step (``pycls.core.training_step``): the learning rate
from the schedule, ACCUM_STEPS micro-batches mixed and run forward and backward under the AMP
level, clipping, the fused optimizer step, the EMA update, device-side meters. The host waits for
the device only every LOG_PERIOD steps, when the meters are synchronised and logged.
"""

import math
import os
import random
import sys
import time

import numpy as np
import torch

from pycls import config
from pycls import distributed as dist
from pycls.checkpoint import opened_weights, resume, run_lock
from pycls.checkpoint.files import CheckpointError
from pycls.core import (
    builders,
    curve_writers,
    finetune,
    meters,
    resume_point,
    run_advice,
    token_costs,
)
from pycls.core import logging as logs
from pycls.core.compile_stats import announce as announce_compiling
from pycls.core.evaluation import Evaluator
from pycls.core.precise_bn import num_precise_batches, recompute_bn_stats
from pycls.core.run_checkpoints import RunCheckpoints
from pycls.datasets.loading import checks
from pycls.datasets.loading.checks import classes_of
from pycls.engines import model_init_device, parallelize
from pycls.engines.base import compile_kwargs, compile_model
from pycls.errors import DivergedError
from pycls.optim.library_optimizers import evaluation_weights

logger = logs.get_logger(__name__)

# float16 loss scaling: this many skipped steps in a row (the scale halved from 2^16 to 2^-8) is a
# run whose every gradient overflows, not a few overflowing batches
MAX_CONSECUTIVE_SKIPS = 24


# ------------------------------------------------------------------------------------------------ #
# Set-up
# ------------------------------------------------------------------------------------------------ #


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_env(cfg, write_config=True):
    """Output folder, resolved config (unless ``write_config`` is False: training writes it once
    the run is accepted), logging, seeds and backend flags; returns the device."""
    if dist.is_main_proc():
        os.makedirs(cfg.OUT_DIR, exist_ok=True)
        if write_config:
            config.dump_cfg(cfg)
    logs.setup_logging(cfg.OUT_DIR)
    checks.set_skipped_files(cfg.OUT_DIR)  # corrupt samples skipped are named there
    device = dist.resolve_device(cfg.DEVICE)
    logger.info(
        f"pycls on {device}, torch {torch.__version__}, {dist.get_world_size()} process(es), "
        f"{torch.get_num_threads()} CPU thread(s) each"
    )
    where = f"; all of it in {os.path.join(cfg.OUT_DIR, cfg.CFG_DEST)}" if write_config else ""
    changed = config.describe_non_default(cfg)  # (training names config.yaml once written)
    logger.info(f"config (keys that differ from the defaults{where}):\n{changed}")
    seed_everything(cfg.RNG_SEED + dist.get_rank())
    # TF32 matmuls on Ampere+ (fp32 runs); cudnn autotuning unless bitwise repeatability is asked
    torch.backends.cuda.matmul.allow_tf32 = not cfg.DETERMINISTIC
    torch.backends.cudnn.allow_tf32 = not cfg.DETERMINISTIC
    torch.backends.cudnn.benchmark = not cfg.DETERMINISTIC
    torch.backends.cudnn.deterministic = cfg.DETERMINISTIC
    return device


def log_complexity(cfg, model):
    cx = model.complexity(cfg.TRAIN.IM_SIZE)
    cx.update(token_costs.effective_complexity(cfg, model))  # patch dropout, token budget
    logs.log_json_stats({"_type": "complexity", "im_size": cfg.TRAIN.IM_SIZE, **cx})
    return cx


def build_training(cfg, device):
    """The engine holding the model (on device, cast for the AMP level, parallelised), the
    optimizer, the loss scaler, the loss and the precision."""
    # On the host; under FSDP2 and the pipeline only rank 0 allocates the whole model (the other
    # processes build it on the meta device) and the engine gives each process its shard or stage
    settings = builders.engine_settings(cfg)
    with model_init_device(settings):
        model = builders.build_model(cfg)
    log_complexity(cfg, model)
    finetune.prepare_model(cfg, model)  # TRAIN.WEIGHTS, TRAIN.FREEZE: before engines wrap it
    builders.memory_format(model, cfg, device)  # a CNN's channels_last, before engines wrap it
    precision = builders.build_precision(cfg, device)
    # the engine moves the model to the device and casts it for the AMP level (except FSDP: its
    # fp32 shards are the master weights)
    engine = parallelize(model, settings, device, precision)
    optimizer = builders.build_optimizer(
        cfg, engine.module, master_weights=engine.optimizer_master_weights
    )
    scaler = engine.make_scaler()
    loss_fn = builders.build_loss_fn(cfg).to(device)
    return engine, optimizer, scaler, loss_fn, precision


def maybe_compile(cfg, model):
    if not cfg.TRAIN.COMPILE:
        return model
    t = cfg.TRAIN
    options = compile_kwargs(t.COMPILE_MODE, t.COMPILE_COORDINATE_DESCENT)
    return compile_model(model, t.COMPILE_SCOPE, **options)


# ------------------------------------------------------------------------------------------------ #
# Loops
# ------------------------------------------------------------------------------------------------ #


def _progress(total, desc):
    """A tqdm bar on an interactive terminal (main process only), else None. A terminal that
    reports 0 columns (some CI pseudo-terminals, editors' shells) gets none: tqdm would print a
    line per update there."""
    if not (dist.is_main_proc() and sys.stderr.isatty()):
        return None
    try:
        if os.get_terminal_size(sys.stderr.fileno()).columns <= 0:
            return None
    except (OSError, ValueError):  # no size to ask for
        return None
    from tqdm import tqdm  # only interactive terminals show a progress bar

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


class Trainer:
    """Holds what the loops share; the loops themselves are train_epoch and test_epoch."""

    def __init__(self, cfg, device):
        self.cfg, self.device = cfg, device
        self.engine, self.optimizer, self.scaler, loss_fn, self.precision = build_training(
            cfg, device
        )
        self.step = builders.build_training_step(
            cfg, self.engine, self.optimizer, self.scaler, loss_fn
        )
        self.mixer, self.ema = self.step.mixer, self.step.ema
        self.sizes = builders.build_image_size_schedule(cfg, dist.get_world_size())
        self.patch_drop = None  # a ViT's patch-dropout rate per epoch, when it drops any
        if cfg.MODEL.TYPE == "vit" and cfg.VIT.PATCH_DROP > 0:
            self.patch_drop = builders.build_patch_drop_schedule(cfg, dist.get_world_size())
        self.train_dataset = builders.build_dataset(cfg, train=True)
        self.train_loader = self.train_batches = self.schedule = None
        self._set_train_batch(self.sizes.batch_size(0))
        self.evaluator = Evaluator(cfg, device, self.precision, loss_fn)
        self.classes = classes_of(self.train_dataset)  # stored in checkpoints
        splits = f"TRAIN.SPLIT {cfg.TRAIN.SPLIT} vs TEST.SPLIT {cfg.TEST.SPLIT}"
        test_dataset = self.evaluator.test_loader.dataset
        checks.check_classes(self.classes, classes_of(test_dataset), splits)  # shifted labels
        checks.check_class_samples(self.train_dataset, test_dataset, splits)
        self.start_epoch = self.start_iter = 0
        self.loader_bound = run_advice.LoaderBoundNotice(cfg)  # said once per run
        self.preemption = None  # a distributed.PreemptionFlag once train_model installs one
        self.watchdog = dist.NO_WATCHDOG  # train_model's once it starts one (TRAIN.HANG_TIMEOUT)
        self.checkpoints = RunCheckpoints(cfg, self.engine, self.optimizer, self.scaler)
        self.best = {"top1_err": float("inf")}
        self._best_due = False  # the last evaluation was the best: model_best.pyth to write

    @property
    def loss_fn(self):
        return self.step.loss_fn

    @loss_fn.setter
    def loss_fn(self, loss_fn):
        """A loss of one's own, for the training step (the evaluator keeps the configured one)."""
        self.step.loss_fn = loss_fn

    def _set_train_batch(self, batch):
        """(Re)builds the training loader and the LR schedule for a global batch size (the
        curriculum may grow it; OPTIM.LR_SCALE_BATCH scales the rate with it)."""
        if self.train_loader is not None and self.global_batch == batch:
            return
        loader = builders.build_loader(self.cfg, True, self.train_dataset, batch_size=batch)
        if len(loader) < self.cfg.TRAIN.ACCUM_STEPS:
            raise config.ConfigError(
                f"TRAIN.BATCH_SIZE: {batch} exceeds the {len(self.train_dataset)} training images "
                "(no full batch to train on)"
            )
        self.train_loader, self.global_batch = loader, batch
        self.train_batches = builders.device_batches(self.cfg, loader, self.device, train=True)
        self.schedule = builders.build_lr_schedule(self.cfg, batch, len(loader))

    def _resize(self, size):
        return self.engine.resize(size, self.optimizer, self.ema)

    def _apply_image_size(self, epoch):
        """The curriculum's size and batch for this epoch, applied to model, state and loader."""
        size = self.sizes.size(epoch)
        if self._resize(size):
            logger.info(f"epoch {epoch + 1}: image size {size} px")
            self.watchdog.long_step()  # a compiled model compiles for the new shapes
        self._set_train_batch(self.sizes.batch_size(epoch))
        self.train_loader.sampler.set_image_size(size)
        self._apply_patch_drop(epoch)

    def _apply_patch_drop(self, epoch):
        """VIT.PATCH_DROP*'s rate for this epoch, set on the model."""
        if self.patch_drop is None:
            return
        rate, module = self.patch_drop(epoch), self.engine.module
        if rate != module.patch_drop:
            module.set_patch_drop(rate)
            logger.info(f"epoch {epoch + 1}: patch dropout {rate:.3f}")

    # -- checkpoints ------------------------------------------------------------------------ #
    def resume_or_init(self):
        """Resumes from the point ``resume_point.find`` decides (TRAIN.AUTO_RESUME), if any; then
        compiles (TRAIN.WEIGHTS went into the model before the engine and the EMA were built)."""
        point = resume_point.find(self)
        if point is not None:
            self._resume_from(point)
        self.engine.compile()

    def _resume_from(self, point):
        hyper = resume_point.snapshot_hyperparameters(self.optimizer)
        # In a curriculum, the saved embedding and its optimizer state have the size trained
        # last: switch to it first, so nothing is resampled on the way in
        self._resize(point.im_size)
        self.engine.load(point.path, point.state, optimizer=self.optimizer, scaler=self.scaler,
                         folder=point.folder)  # fmt: skip
        resume_point.apply_hyperparameters(self.optimizer, hyper, point.path)  # the config's
        if self.ema is not None and "ema_state" in point.state:
            self.ema.load_state_dict(point.state["ema_state"])
        self.start_epoch, self.start_iter = point.epoch, point.steps
        self.best, self.evaluator.min_top1_err = point.best, point.min_top1_err
        point.announce()

    def save(self, epoch, it=0):
        """Checkpoint after ``epoch`` epochs (+ ``it`` steps of the next when preempted); every
        process calls it. Returns its path on rank 0."""
        return self.checkpoints.save(epoch, it, resume_point.checkpoint_extra(self, epoch, it))

    def _note_best(self, epoch, raw_stats, ema_stats):
        """Whether this evaluation is the best so far (raw or EMA weights), for ``_save_best``."""
        candidates = [(raw_stats["top1_err"], "raw")]
        if ema_stats is not None:
            candidates.append((ema_stats["top1_err"], "ema"))
        err, kind = min(candidates)
        if err < self.best["top1_err"]:
            self.best, self._best_due = {"top1_err": err, "epoch": epoch + 1, "weights": kind}, True

    def _save_best(self):
        """Writes OUT_DIR/checkpoints/model_best.pyth after the epoch's checkpoint, if the last
        evaluation was the best: a failed checkpoint write stops the run before this."""
        if self._best_due:
            self._best_due = False
            self.checkpoints.save_best(self.best, self.classes, self.ema)

    # -- one training epoch ----------------------------------------------------------------- #
    def train_epoch(self, epoch):
        cfg, accum = self.cfg, self.cfg.TRAIN.ACCUM_STEPS
        self._apply_image_size(epoch)
        n_steps = len(self.train_loader) // accum  # a partial accumulation at the end is dropped
        done = self.start_iter if epoch == self.start_epoch else 0  # steps before a preemption
        # A resumed epoch starts after the batches trained before the stop (not decoded again)
        self.train_loader.sampler.set_epoch(epoch, skip=done * accum * self.train_loader.batch_size)
        self.engine.train()
        meter = meters.Meter(self.device)
        bar = _progress(n_steps, f"epoch {epoch + 1}/{cfg.OPTIM.MAX_EPOCH}")
        if bar is not None:
            bar.update(done)
        skipped_before = self.scaler.skipped_steps
        mixing = self.mixer.active(epoch)
        lr = self.schedule(epoch)
        compiling = cfg.TRAIN.COMPILE and not getattr(self, "_compiled", False)
        if compiling:  # a step of any length (the watchdog's too)
            self.watchdog.long_step()
            announce_compiling(cfg.TRAIN.COMPILE_SCOPE, self.device.type)
        batches = meter.timed(self.train_batches)  # the wait for each batch: data_wait_share
        for step in range(done, n_steps):
            lr = self.schedule(epoch + step / n_steps)
            with dist.stop_at(self._stop, epoch, step):  # a wait for data a stop signal ended
                self.step(batches, lr, mixing, meter)
            if compiling:  # torch.compile compiles on the first call: not a step's usual time
                compiling, self._compiled = False, True
                logger.info(f"compiled: first step {meter.restart_clock():.1f} s")
            if bar is not None:
                bar.update(1)
            if (step + 1) % cfg.LOG_PERIOD == 0 or step + 1 == n_steps:
                self.watchdog.arrive("the meters' sync")
                stats = meter.sync()
                self._check_finite(stats, epoch, step, skipped_before)
                self._log_iter(stats, meter, epoch, step, n_steps, lr, bar)
                if step + 1 < n_steps and self._stop_requested():
                    self._stop(epoch, step + 1)
        if bar is not None:
            bar.close()
        meter.sync()
        stats = meter.epoch_stats()
        where = f"training samples of epoch {epoch + 1}"
        checks.refuse_all_skipped(stats, where, "nothing was trained", cfg.OUT_DIR)
        self._check_finite(stats, epoch, n_steps - 1, skipped_before)
        self.loader_bound.epoch_done(stats.get("data_wait_share", 0.0), epoch)
        stats.update(
            _type="train_epoch",
            epoch=f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
            epoch_num=epoch + 1,
            lr=lr,
            time_epoch=time.perf_counter() - meter.epoch_start,
            im_size=self.train_loader.sampler.image_size,
            batch_size=self.global_batch,
            skipped_steps=self.scaler.skipped_steps - skipped_before,
            mem=meters.gpu_mem_usage_mb(),
        )
        logs.log_json_stats(stats)
        return stats

    def _check_finite(self, stats, epoch, it, skipped_before):
        cfg = self.cfg
        where = f"at epoch {epoch + 1}, iteration {it + 1}"
        amp = f"AMP.LEVEL={cfg.AMP.LEVEL}, AMP.DTYPE={cfg.AMP.DTYPE}"
        skips = self.scaler.consecutive_skips
        if skips >= MAX_CONSECUTIVE_SKIPS:  # float16: every gradient overflows, step after step
            raise DivergedError(
                f"the float16 loss scaler skipped the last {skips} steps {where} (every "
                f"gradient overflowed; loss scale now {self.scaler.get_scale():.3g}; {amp}, "
                f"OPTIM.BASE_LR={cfg.OPTIM.BASE_LR}): the run has diverged; stopping without "
                "writing a checkpoint for this epoch. Try a lower OPTIM.BASE_LR, OPTIM.CLIP_GRAD "
                "or AMP.DTYPE bfloat16"
            )
        if math.isfinite(stats["loss"]):
            return
        # Under float16 an overflowing step is skipped by the loss scaler, not fatal
        if self.precision.uses_loss_scaling and self.scaler.skipped_steps > skipped_before:
            return
        raise DivergedError(
            f"loss is {stats['loss']} {where} ({amp}, OPTIM.BASE_LR={cfg.OPTIM.BASE_LR}); stopping "
            f"without writing a checkpoint for this epoch. {run_advice.divergence_advice(cfg)}"
        )

    def _log_iter(self, stats, meter, epoch, step, n_steps, lr, bar):
        cfg = self.cfg
        remaining = (cfg.OPTIM.MAX_EPOCH - epoch) * n_steps - (step + 1)
        stats.update(
            _type="train_iter",
            epoch=f"{epoch + 1}/{cfg.OPTIM.MAX_EPOCH}",
            iter=f"{step + 1}/{n_steps}",
            time_avg=meter.iter_time,
            eta=meters.eta_str(meter.iter_time * remaining),
            lr=lr,
            mem=meters.gpu_mem_usage_mb(),
        )
        if bar is not None:
            bar.set_postfix(loss=f"{stats['loss']:.3f}", err=f"{stats['top1_err']:.1f}")
            bar.clear()
        logs.log_json_stats(stats)

    def _precise_bn(self):
        """BN.USE_PRECISE_STATS: the model's BN statistics recomputed on training batches."""
        bn = self.cfg.BN
        if not bn.USE_PRECISE_STATS:
            return
        loader, p, module = self.train_loader, self.precision, self.engine.module
        n = num_precise_batches(
            bn.NUM_SAMPLES_PRECISE, loader.batch_size, len(loader), dist.get_world_size()
        )

        def forward(images):  # the plain module: DDP would broadcast rank 0's statistics
            with p.autocast():
                module(p.cast_input(images))

        recompute_bn_stats(module, self.train_batches, n, forward)

    def test_epoch(self, epoch):
        """Evaluates the model (and its EMA) at the final or the current training size."""
        size = None if self.cfg.CURRICULUM.EVAL_AT_FINAL_SIZE else self.sizes.size(epoch)
        with evaluation_weights(self.optimizer):  # Schedule-Free's average (training's after)
            self._precise_bn()
            stats = self.evaluator.run(self.engine, epoch, image_size=size)
            ema_stats = None
            if self.ema is not None:
                with self.ema.swapped_into(self.engine.module):
                    self._precise_bn()  # for the averaged weights, undone with the swap
                    ema_stats = self.evaluator.run(self.engine, epoch, "test_epoch_ema", size)
        self._note_best(epoch, stats, ema_stats)
        return stats

    # -- the run ---------------------------------------------------------------------------- #
    def fit(self):
        cfg = self.cfg
        max_epoch = cfg.OPTIM.MAX_EPOCH
        test_stats = None
        if self.start_epoch >= max_epoch:
            logger.info(f"nothing to train: the checkpoint is at epoch {self.start_epoch}")
            with self.watchdog.paused():
                test_stats = self.test_epoch(max_epoch - 1)
                self._save_best()
                self.checkpoints.wait()
            return test_stats
        for epoch in range(self.start_epoch, max_epoch):
            self.train_epoch(epoch)
            last = epoch + 1 == max_epoch
            with self.watchdog.paused():  # no training steps: as long as they take
                if (epoch + 1) % cfg.TRAIN.EVAL_PERIOD == 0 or last:
                    # a stop during the evaluation: the epoch's checkpoint, not evaluated
                    with dist.stop_at(self._stop, epoch + 1):
                        test_stats = self.test_epoch(epoch)
                if (epoch + 1) % cfg.TRAIN.CHECKPOINT_PERIOD == 0 or last:
                    self.save(epoch + 1)
                self._save_best()
                if last:  # the run is done once its last checkpoint is whole
                    self.checkpoints.wait()
            if not last and self._stop_requested():
                self._stop(epoch + 1)
        return test_stats

    # -- preemption (SIGTERM / SIGUSR1, see distributed.PreemptionFlag) --------------------- #
    def _stop_requested(self):
        """Whether any process was signalled to stop (a collective: called at the same points
        everywhere, at LOG_PERIOD boundaries and epoch ends)."""
        self.watchdog.arrive("the stop check")
        return self.preemption is not None and self.engine.any(self.preemption.requested)

    def _stop(self, epoch, it=0):
        """Writes the checkpoint of this point (unless just written) and exits with
        distributed.PREEMPTED_EXIT_CODE; auto-resume continues from it, mid-epoch included."""
        with self.watchdog.paused():
            if self.checkpoints.last_saved != (epoch, it):
                self.save(epoch, it)
            self.checkpoints.wait()
        ctrl_c = self.preemption.interrupted
        logger.info(f"stopping on {'Ctrl-C' if ctrl_c else 'a preemption signal'} after epoch "
                    f"{epoch} + {it} steps")  # fmt: skip
        raise dist.Preempted(dist.INTERRUPTED_EXIT_CODE if ctrl_c else dist.PREEMPTED_EXIT_CODE)


def check_processes(cfg, world_size):
    """Several processes with TRAIN.PARALLEL none would each train a copy of the model of its
    own, unsynchronised, and log an accuracy no checkpoint reproduces: refused, naming the key
    (evaluating and timing with several processes is fine)."""
    if world_size > 1 and cfg.TRAIN.PARALLEL == "none":
        raise config.ConfigError(
            f"TRAIN.PARALLEL: none with {world_size} processes (NUM_PROCS, torchrun or srun) "
            f"would train {world_size} unsynchronised copies of the model; set TRAIN.PARALLEL "
            "ddp (or fsdp, pipeline), or run one process"
        )


def train_model(cfg):
    """Trains the model cfg describes; returns the last test_epoch stats."""
    check_processes(cfg, dist.get_world_size())
    # One run per OUT_DIR: rank 0 takes the lock before anything is written there (every
    # process stops if it is taken); then what writers that died left behind is removed
    lock = run_lock.hold_out_dir(cfg.OUT_DIR, dist.is_main_proc(), dist.broadcast_object)
    try:
        return _train_locked(cfg, lock)
    finally:
        if lock is not None:
            lock.release()


def _train_locked(cfg, lock):
    device = setup_env(cfg, write_config=False)
    if lock is not None:
        resume.remove_stale_temporaries(cfg.OUT_DIR)
    dist.barrier()
    # SLURM / torchrun / submitit warn before killing: checkpoint at the next sync point and exit
    preemption = dist.PreemptionFlag().install()
    curves = curve_writers.open_sink(cfg)  # TENSORBOARD, WANDB_PROJECT
    trainer = None
    try:
        trainer = Trainer(cfg, device)
        trainer.preemption = preemption
        trainer.resume_or_init()
        if dist.is_main_proc():  # accepted (a refused resume keeps a finished run's config.yaml)
            logger.info(f"wrote {config.dump_cfg(cfg)}")
        t = cfg.TRAIN  # a hung step found and named
        watchdog = dist.start_watchdog(t.HANG_TIMEOUT, t.HANG_CHECK_PERIOD, cfg.OUT_DIR)
        trainer.watchdog = trainer.step.watchdog = watchdog
        test_stats = trainer.fit()
        trainer.checkpoints.save_final_weights()
    finally:
        if trainer is not None:  # an error: the checkpoint write in flight finishes first
            trainer.checkpoints.close()
            trainer.watchdog.stop()
        curve_writers.close_sink(curves)
        preemption.uninstall()
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
        raise config.ConfigError("TEST.WEIGHTS: --mode test needs the checkpoint to evaluate")
    model = builders.build_model(cfg, image_size=cfg.TEST.IM_SIZE)
    log_complexity(cfg, model)
    path = builders.weights_file(cfg, "TEST.WEIGHTS")  # a path, or zoo:NAME's published file
    # What the file is (a run folder: its newest checkpoint) decided once, and read by its kind
    opened = opened_weights.open_weights(path, "TEST.WEIGHTS", cfg.ALLOW_UNVERIFIED_CHECKPOINTS)
    if opened.kind == "state dict":  # another program's weights: TRAIN.WEIGHTS reads those
        raise CheckpointError(opened.refused)
    state = opened.load_into(model)  # None for weights alone: no class list to check against
    path = opened.path
    precision = builders.build_precision(cfg, device)
    builders.memory_format(model, cfg, device)
    model = maybe_compile(cfg, precision.prepare_model(model.to(device)))
    evaluator = Evaluator(cfg, device, precision, builders.build_loss_fn(cfg).to(device))
    checks.check_classes(  # the classes the checkpoint was trained on
        (state or {}).get("classes"),
        classes_of(evaluator.test_loader.dataset),
        f"checkpoint {path} vs TEST.SPLIT {cfg.TEST.SPLIT}",
    )
    # Labelled with the checkpoint's own epoch (a file without one: the end of the run)
    epoch = (state or {}).get("epoch")
    done = epoch if isinstance(epoch, int) and epoch > 0 else cfg.OPTIM.MAX_EPOCH
    return evaluator.run(model, done - 1)
