"""Training builders: the loss, the optimizer, the AMP level, the engine's and the launcher's
settings, the schedules, the mixer, the EMA and the one training step, from the config (the
tables of what the keys become are the config sections': ``pycls.config.sections``).
"""

import functools

import torch
from torch import nn

from pycls import distributed as dist
from pycls.config.sections import amp, engine, optimization
from pycls.core import logging as logs
from pycls.core.builders.data_builders import token_budget_images
from pycls.core.builders.model_builders import build_teacher
from pycls.core.distillation import DistillationLoss
from pycls.core.ema import ModelEMA
from pycls.core.losses import BinaryCrossEntropy
from pycls.core.schedules import (
    FixedImageSize,
    ImageSizeCurriculum,
    LRSchedule,
    PatchDropSchedule,
)
from pycls.core.training_step import TrainingStep
from pycls.datasets.loading.token_batches import (
    TokenBatchMixer,
)
from pycls.datasets.loading.transforms import BatchMixer
from pycls.distributed.launch_settings import LaunchSettings
from pycls.engines import (
    AmpSettings,
    DDPSettings,
    EngineSettings,
    FSDPSettings,
    MeshSettings,
    PipelineSettings,
    Precision,
)
from pycls.models.vit.token_masks import computed_tokens
from pycls.optim import OnePassAdamW, OptimizerSettings, optimizer_from_settings

logger = logs.get_logger(__name__)


def build_loss_fn(cfg):
    """MODEL.LOSS_FUN with TRAIN.LABEL_SMOOTHING (class indices or soft targets): softmax
    cross-entropy, or binary cross-entropy binarised at MODEL.BCE_TARGET_THRESHOLD."""
    smoothing = cfg.TRAIN.LABEL_SMOOTHING
    if cfg.MODEL.LOSS_FUN == "binary_cross_entropy":
        threshold = cfg.MODEL.BCE_TARGET_THRESHOLD
        return BinaryCrossEntropy(smoothing, threshold if threshold >= 0 else None)
    return nn.CrossEntropyLoss(label_smoothing=smoothing)


def arguments(table, cfg):
    """The plain arguments (or settings) a section's table gives for ``cfg``: {argument: value}
    (the tables: ``pycls.config.sections``)."""
    return {arg: read(cfg) for arg, read in table.items()}


def optimizer_settings(cfg):
    """The OptimizerSettings the OPTIM and MUON keys describe (``optimization.OPTIMIZER_SETTINGS``:
    layer decay over the ViT's blocks)."""
    return OptimizerSettings(**arguments(optimization.OPTIMIZER_SETTINGS, cfg))


def build_optimizer(cfg, model, master_weights=False):
    """The optimizer OPTIM describes, over weight-decay groups built from ``model`` (build it
    after the model is on its device and cast for the AMP level)."""
    return optimizer_from_settings(model, optimizer_settings(cfg), master_weights)


def build_precision(cfg, device):
    """The Precision AMP.LEVEL and AMP.DTYPE describe (``amp.AMP_SETTINGS``), for a torch.device
    (the CPU's level was resolved when the config loaded)."""
    s = AmpSettings(**arguments(amp.AMP_SETTINGS, cfg))
    return Precision(s.level, s.dtype, torch.device(device).type)


def engine_settings(cfg):
    """The EngineSettings of TRAIN.PARALLEL (FSDP.BACKEND), DDP.*, FSDP.*, PIPELINE.*, MESH.*,
    AMP.REDUCE_DTYPE, AMP.FLOAT8(_MIN_DIM, _LAYERS), TRAIN.COMPILE(_SCOPE, _MODE,
    _COORDINATE_DESCENT) and BN.SYNC (the tables of ``pycls.config.sections.engine``), with one
    process's micro-batch, which AMP.FLOAT8_LAYERS auto weighs (TRAIN.BATCH_SIZE over this run's
    processes and TRAIN.ACCUM_STEPS)."""
    micro_batch = cfg.TRAIN.BATCH_SIZE // (dist.get_world_size() * cfg.TRAIN.ACCUM_STEPS)
    return EngineSettings(
        **arguments(engine.ENGINE_SETTINGS, cfg),
        float8_micro_batch=micro_batch,
        ddp=DDPSettings(**arguments(engine.DDP_SETTINGS, cfg)),
        fsdp=FSDPSettings(**arguments(engine.FSDP_SETTINGS, cfg)),
        pipeline=PipelineSettings(**arguments(engine.PIPELINE_SETTINGS, cfg)),
        mesh=MeshSettings(**arguments(engine.MESH_SETTINGS, cfg)),
    )


def launch_settings(cfg):
    """The LaunchSettings of NUM_PROCS, CPU_THREADS, DEVICE and the engine's needs
    (``engine.LAUNCH_SETTINGS``)."""
    return LaunchSettings(**arguments(engine.LAUNCH_SETTINGS, cfg))


def build_lr_schedule(cfg, global_batch_size=None, batches_per_epoch=None):
    """The schedule that OPTIM describes, with the linear scaling rule applied if configured;
    an epoch is ``batches_per_epoch`` loader batches (OPTIM.WARMUP_STEPS counts optimizer steps:
    TRAIN.ACCUM_STEPS batches each; None: the run's warmup in epochs only)."""
    o, args = cfg.OPTIM, arguments(optimization.LR_SCHEDULE_ARGS, cfg)
    if batches_per_epoch is not None:
        args["steps_per_epoch"] = max(batches_per_epoch // cfg.TRAIN.ACCUM_STEPS, 1)
    if o.LR_SCALE_BATCH > 0:
        scale = (global_batch_size or cfg.TRAIN.BATCH_SIZE) / o.LR_SCALE_BATCH
        args.update(base_lr=args["base_lr"] * scale, min_lr=args["min_lr"] * scale)
    return LRSchedule(**args)


def build_image_size_schedule(cfg, world_size=1):
    """The training image size (and batch) per epoch: fixed, or CURRICULUM's. Under a token
    budget the batch is the budget's worth of images at TRAIN.IM_SIZE (what the learning rate
    scales with; the loader sets the real batches)."""
    c, t = cfg.CURRICULUM, cfg.TRAIN
    if t.TOKEN_BUDGET > 0:
        return FixedImageSize(t.IM_SIZE, token_budget_images(cfg))
    if not c.ENABLED:
        return FixedImageSize(t.IM_SIZE, t.BATCH_SIZE)
    return ImageSizeCurriculum(
        start=c.START_SIZE,
        step=c.STEP,
        epochs_per_step=c.EPOCHS_PER_STEP,
        final=t.IM_SIZE,
        base_batch=t.BATCH_SIZE,
        scale_batch=c.SCALE_BATCH,
        batch_multiple=world_size * t.ACCUM_STEPS,
    )


def build_patch_drop_schedule(cfg, world_size=1):
    """The patch-dropout rate per epoch that VIT.PATCH_DROP* describe."""
    v = cfg.VIT
    return PatchDropSchedule(
        v.PATCH_DROP,
        schedule=v.PATCH_DROP_SCHEDULE,
        sizes=build_image_size_schedule(cfg, world_size),
        patch_size=v.PATCH_SIZE,
        off_epoch=v.PATCH_DROP_OFF_EPOCH,
    )


def build_mixer(cfg):
    """The BatchMixer MIXUP describes (mixup / cutmix with soft targets; a no-op at alpha 0); under
    a token budget, one that also mixes token batches per image."""
    m = cfg.MIXUP
    if cfg.TRAIN.TOKEN_BUDGET > 0:
        return TokenBatchMixer(
            cfg.MODEL.NUM_CLASSES,
            patch_size=cfg.VIT.PATCH_SIZE,
            mixup_alpha=m.ALPHA,
            cutmix_alpha=m.CUTMIX_ALPHA,
            prob=m.PROB,
            switch_prob=m.SWITCH_PROB,
            off_epoch=m.OFF_EPOCH,
        )
    return BatchMixer(
        cfg.MODEL.NUM_CLASSES,
        mixup_alpha=m.ALPHA,
        cutmix_alpha=m.CUTMIX_ALPHA,
        prob=m.PROB,
        switch_prob=m.SWITCH_PROB,
        off_epoch=m.OFF_EPOCH,
    )


def build_ema(cfg, module):
    """The ModelEMA of ``module`` that TRAIN.EMA* describe, or None when TRAIN.EMA is off."""
    t = cfg.TRAIN
    if not t.EMA:
        return None
    return ModelEMA(module, t.EMA_DECAY, warmup=t.EMA_WARMUP, period=t.EMA_PERIOD)


def build_training_step(cfg, engine, optimizer, scaler, loss_fn):
    """The one training step (accumulation, clipping, mixup/cutmix, EMA, distillation) the config
    describes, over what ``pycls.core.trainer.build_training`` built."""
    teacher = None
    if cfg.DISTILL.TYPE != "none":
        teacher = build_teacher(cfg, engine.device, engine.precision)
        d = cfg.DISTILL
        loss_fn = DistillationLoss(loss_fn, d.TYPE, d.ALPHA, d.TAU)
        if cfg.MODEL.TYPE == "vit" and cfg.VIT.DIST_TOKEN:  # the heads' logits apart
            engine.module.set_distilled_training(True)
    ema = build_ema(cfg, engine.module)
    if ema is not None and isinstance(optimizer, OnePassAdamW):  # OPTIM.ONE_PASS: in its pass
        optimizer.attach_ema(ema, engine.module)
    return TrainingStep(
        engine,
        optimizer,
        scaler,
        loss_fn,
        accum_steps=cfg.TRAIN.ACCUM_STEPS,
        clip_grad=cfg.OPTIM.CLIP_GRAD,
        mixer=build_mixer(cfg),
        ema=ema,
        count_tokens=build_token_counter(cfg, engine.module),
        teacher=teacher,
    )


def build_token_counter(cfg, module):
    """For a ViT, the function counting the token positions its blocks compute per micro-batch
    (the meters' tokens/s and tokens per image); None for the CNNs."""
    if cfg.MODEL.TYPE != "vit":
        return None
    return functools.partial(computed_tokens, module)
