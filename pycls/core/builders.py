"""Builders: the only place where the config becomes constructor arguments.

Models, losses, datasets and loaders take explicit arguments; these functions read the config and
pass them on, so library code never depends on the process-wide config.
"""

import functools
import os

import torch
from torch import nn

from pycls import config, datasets
from pycls import distributed as dist
from pycls.checkpoint import resume, sharded, weight_files
from pycls.config import ConfigError, resnet_layout
from pycls.config.validation import TEACHER_TIMM, TEACHER_ZOO, engine_name
from pycls.core import logging as logs
from pycls.core.distillation import DistillationLoss, Teacher
from pycls.core.ema import ModelEMA
from pycls.core.schedules import FixedImageSize, ImageSizeCurriculum, LRSchedule
from pycls.core.training_step import TrainingStep
from pycls.datasets import (
    DATASET_STATS,
    DEFAULT_AUGMENT,
    AugmentedDataset,
    DeviceBatches,
    build_transform,
    construct_loader,
)
from pycls.datasets.gpu_augment import (
    DEVICE_PRESETS,
    DeviceAugment,
    DeviceAugmentBatches,
    DeviceAugmentDataset,
    construct_device_loader,
)
from pycls.datasets.shards import ShardDataset
from pycls.datasets.subset import ClassSubset
from pycls.datasets.transforms import BatchMixer
from pycls.distributed.preflight import LaunchSettings
from pycls.engines import DDPSettings, EngineSettings, FSDPSettings, PipelineSettings, Precision
from pycls.errors import UserError
from pycls.models import zoo
from pycls.models.anynet import AnyNet
from pycls.models.effnet import EffNet
from pycls.models.regnet import RegNet
from pycls.models.resnet import ResNet
from pycls.models.vit import VisionTransformer
from pycls.optim import OptimizerSettings, optimizer_from_settings

logger = logs.get_logger(__name__)

# ------------------------------------------------------------------------------------------------ #
# Models: each family's constructor arguments, one line each, read from the config
# ------------------------------------------------------------------------------------------------ #

# A family's argument table: {constructor argument: how the config gives it}. The same table
# builds the model and tells which keys shape it (model_keys), so the two cannot drift
VIT_ARGS = {
    "image_size": lambda c: c.TRAIN.IM_SIZE,
    "patch_size": lambda c: c.VIT.PATCH_SIZE,
    "num_classes": lambda c: c.MODEL.NUM_CLASSES,
    "depth": lambda c: c.VIT.DEPTH,
    "width": lambda c: c.VIT.WIDTH,
    "num_heads": lambda c: c.VIT.NUM_HEADS,
    "mlp_dim": lambda c: c.VIT.MLP_DIM,
    "stem": lambda c: c.VIT.STEM_TYPE,
    "conv_stem_channels": lambda c: tuple(c.VIT.C_STEM_CHANNELS),
    "conv_stem_kernels": lambda c: tuple(c.VIT.C_STEM_KERNELS),
    "conv_stem_strides": lambda c: tuple(c.VIT.C_STEM_STRIDES),
    "classifier": lambda c: c.VIT.CLASSIFIER,
    "layout": lambda c: c.VIT.LAYOUT,
    "ffn": lambda c: c.VIT.FFN,
    "pos_embed": lambda c: c.VIT.POS_EMBED,
    "dropout": lambda c: c.VIT.DROPOUT,
    "attn_dropout": lambda c: c.VIT.ATTN_DROPOUT,
    "drop_path": lambda c: c.VIT.DROP_PATH,
    "norm_eps": lambda c: c.VIT.NORM_EPS,
    "checkpoint_blocks": lambda c: c.VIT.CHECKPOINT_BLOCKS,
    "class_token": lambda c: c.VIT.CLASSIFIER == "token" or c.VIT.CLASS_TOKEN,
    "num_registers": lambda c: c.VIT.NUM_REGISTERS,
    "qkv_bias": lambda c: c.VIT.QKV_BIAS,
    "pre_norm": lambda c: c.VIT.PRE_NORM,
    "fc_norm": lambda c: c.VIT.FC_NORM,
    "head_init_scale": lambda c: c.VIT.HEAD_INIT_SCALE,
    "dist_token": lambda c: c.VIT.DIST_TOKEN,
}
# What every CNN family takes: classes, batch norm, activation
CNN_COMMON_ARGS = {
    "num_classes": lambda c: c.MODEL.NUM_CLASSES,
    "bn_eps": lambda c: c.BN.EPS,
    "bn_momentum": lambda c: c.BN.MOM,
    "zero_init_final_gamma": lambda c: c.BN.ZERO_INIT_FINAL_GAMMA,
    "activation": lambda c: c.MODEL.ACTIVATION_FUN,
    "activation_inplace": lambda c: c.MODEL.ACTIVATION_INPLACE,
}
ANYNET_ARGS = {
    "stem_type": lambda c: c.ANYNET.STEM_TYPE,
    "stem_w": lambda c: c.ANYNET.STEM_W,
    "block_type": lambda c: c.ANYNET.BLOCK_TYPE,
    "depths": lambda c: tuple(c.ANYNET.DEPTHS),
    "widths": lambda c: tuple(c.ANYNET.WIDTHS),
    "strides": lambda c: tuple(c.ANYNET.STRIDES),
    "bot_muls": lambda c: tuple(c.ANYNET.BOT_MULS),
    "group_ws": lambda c: tuple(c.ANYNET.GROUP_WS),
    "head_w": lambda c: c.ANYNET.HEAD_W,
    "se_r": lambda c: c.ANYNET.SE_R if c.ANYNET.SE_ON else 0.0,
    **CNN_COMMON_ARGS,
}
REGNET_ARGS = {
    "w_a": lambda c: c.REGNET.WA,
    "w_0": lambda c: c.REGNET.W0,
    "w_m": lambda c: c.REGNET.WM,
    "depth": lambda c: c.REGNET.DEPTH,
    "group_w": lambda c: c.REGNET.GROUP_W,
    "bot_mul": lambda c: c.REGNET.BOT_MUL,
    "stride": lambda c: c.REGNET.STRIDE,
    "stem_type": lambda c: c.REGNET.STEM_TYPE,
    "stem_w": lambda c: c.REGNET.STEM_W,
    "block_type": lambda c: c.REGNET.BLOCK_TYPE,
    "head_w": lambda c: c.REGNET.HEAD_W,
    "se_r": lambda c: c.REGNET.SE_R if c.REGNET.SE_ON else 0.0,
    **CNN_COMMON_ARGS,
}
RESNET_ARGS = {
    "depth": lambda c: c.MODEL.DEPTH,
    "layout": resnet_layout,
    "trans_fun": lambda c: c.RESNET.TRANS_FUN,
    "num_groups": lambda c: c.RESNET.NUM_GROUPS,
    "width_per_group": lambda c: c.RESNET.WIDTH_PER_GROUP,
    "stride_1x1": lambda c: c.RESNET.STRIDE_1X1,
    **CNN_COMMON_ARGS,
}
EFFNET_ARGS = {
    "stem_w": lambda c: c.EN.STEM_W,
    "depths": lambda c: tuple(c.EN.DEPTHS),
    "widths": lambda c: tuple(c.EN.WIDTHS),
    "exp_ratios": lambda c: tuple(c.EN.EXP_RATIOS),
    "strides": lambda c: tuple(c.EN.STRIDES),
    "kernels": lambda c: tuple(c.EN.KERNELS),
    "se_r": lambda c: c.EN.SE_R,
    "head_w": lambda c: c.EN.HEAD_W,
    "dc_ratio": lambda c: c.EN.DC_RATIO,
    "dropout_ratio": lambda c: c.EN.DROPOUT_RATIO,
    **CNN_COMMON_ARGS,
}
# MODEL.TYPE -> (the model class, its argument table)
FAMILIES = {
    "vit": (VisionTransformer, VIT_ARGS),
    "anynet": (AnyNet, ANYNET_ARGS),
    "regnet": (RegNet, REGNET_ARGS),
    "resnet": (ResNet, RESNET_ARGS),
    "effnet": (EffNet, EFFNET_ARGS),
}


def model_kwargs(cfg, family=None):
    """The constructor arguments of the model family MODEL.TYPE (or ``family``) that cfg
    describes."""
    _, table = FAMILIES[family or cfg.MODEL.TYPE]
    return {arg: read(cfg) for arg, read in table.items()}


def vit_kwargs(cfg, image_size=None):
    """The VisionTransformer arguments that cfg describes (at ``image_size`` if given)."""
    kwargs = model_kwargs(cfg, "vit")
    return {**kwargs, "image_size": image_size or kwargs["image_size"]}


def build_model(cfg, image_size=None):
    """The model MODEL.TYPE names, on the CPU in fp32 (the trainer moves and casts it), at
    ``image_size`` (default TRAIN.IM_SIZE)."""
    cls, _ = FAMILIES[cfg.MODEL.TYPE]
    if cls is VisionTransformer:
        return VisionTransformer(**vit_kwargs(cfg, image_size))
    model = cls(**model_kwargs(cfg))
    # A CNN takes any image size; it records the one it is built for (complexity, engines)
    model.set_image_size(image_size or cfg.TRAIN.IM_SIZE)
    return model


class _KeyRecorder:
    """A read-only view of a config that records the dotted keys read through it."""

    def __init__(self, node, read, prefix=""):
        self._node, self._read, self._prefix = node, read, prefix

    def __getattr__(self, name):
        value = self._node[name]
        if isinstance(value, dict):
            return _KeyRecorder(value, self._read, f"{self._prefix}{name}.")
        self._read.add(self._prefix + name)
        return value


def model_keys(cfg):
    """The config keys that shape the model MODEL.TYPE names: those its argument table reads for
    every argument but the model class's TRAINING_ONLY_ARGS (a checkpoint resumes under other
    values of those). Derived from the table that builds the model, never listed by hand."""
    cls, table = FAMILIES[cfg.MODEL.TYPE]
    keys = {"MODEL.TYPE"}
    for arg, read in table.items():
        if arg not in cls.TRAINING_ONLY_ARGS:
            read(_KeyRecorder(cfg, keys))
    return sorted(keys)


# TRAIN.WEIGHTS / TEST.WEIGHTS prefix naming a published zoo model ("zoo:RegNetY-800MF")
ZOO_PREFIX = "zoo:"


def weights_file(cfg, key):
    """The file that TRAIN.WEIGHTS or TEST.WEIGHTS (``key``) names: the path as written, or for
    "zoo:NAME" the published weights of the zoo model NAME, from MODEL.ZOO_DIR (else
    $PYCLS_ZOO_DIR, else ~/.cache/pycls/zoo) or downloaded there."""
    path = cfg.TRAIN.WEIGHTS if key == "TRAIN.WEIGHTS" else cfg.TEST.WEIGHTS
    if not path.startswith(ZOO_PREFIX):
        return path
    try:
        return zoo.fetch_weights(path[len(ZOO_PREFIX) :], cfg.MODEL.ZOO_DIR or None)
    except (ValueError, zoo.PretrainedWeightsUnavailable) as e:
        raise ConfigError(f"{key}: {e}") from None


def channels_last(cfg, device):
    """Whether MODEL.MEMORY_FORMAT puts this run's CNN and its batches in channels_last."""
    fmt = cfg.MODEL.MEMORY_FORMAT
    if cfg.MODEL.TYPE == "vit" or fmt == "contiguous":
        return False
    if fmt == "channels_last":
        return True
    device = dist.resolve_device(cfg.DEVICE) if device is None else torch.device(device)
    return device.type == "cuda" and cfg.TRAIN.PARALLEL in ("none", "ddp")


def memory_format(model, cfg, device):
    """The model in the memory format MODEL.MEMORY_FORMAT gives (in place; returns it)."""
    if channels_last(cfg, device):
        model.to(memory_format=torch.channels_last)
    return model


def build_loss_fn(cfg):
    """Cross-entropy with label smoothing (accepts class indices or soft targets)."""
    return nn.CrossEntropyLoss(label_smoothing=cfg.TRAIN.LABEL_SMOOTHING)


def optimizer_settings(cfg):
    """The OptimizerSettings the OPTIM and MUON keys describe (layer decay over the ViT's
    blocks)."""
    o, m = cfg.OPTIM, cfg.MUON
    return OptimizerSettings(
        name=o.OPTIMIZER,
        lr=o.BASE_LR,
        weight_decay=o.WEIGHT_DECAY,
        no_decay_weight_decay=o.WEIGHT_DECAY_NO_DECAY_GROUP,
        layer_decay=o.LAYER_DECAY,
        depth=cfg.VIT.DEPTH,
        momentum=o.MOMENTUM,
        dampening=o.DAMPENING,
        nesterov=o.NESTEROV,
        betas=tuple(o.BETAS),
        eps=o.EPS,
        contiguous=o.CONTIGUOUS_PARAMS,
        muon_lr_mult=m.LR_MULT,
        muon_weight_decay=m.WEIGHT_DECAY,
        muon_momentum=m.MOMENTUM,
        muon_nesterov=m.NESTEROV,
        muon_ns_steps=m.NS_STEPS,
        muon_adjust_lr=m.ADJUST_LR,
    )


def build_optimizer(cfg, model, master_weights=False):
    """The optimizer OPTIM describes, over weight-decay groups built from ``model`` (build it
    after the model is on its device and cast for the AMP level)."""
    return optimizer_from_settings(model, optimizer_settings(cfg), master_weights)


def build_precision(cfg, device):
    """The Precision AMP.LEVEL and AMP.DTYPE describe, for a torch.device (the CPU's level was
    resolved when the config loaded)."""
    return Precision(cfg.AMP.LEVEL, cfg.AMP.DTYPE, torch.device(device).type)


def engine_settings(cfg):
    """The EngineSettings of TRAIN.PARALLEL (FSDP.BACKEND), DDP.*, FSDP.*, PIPELINE.*,
    AMP.REDUCE_DTYPE, AMP.FLOAT8(_MIN_DIM), TRAIN.COMPILE(_SCOPE) and BN.SYNC."""
    d, f, p = cfg.DDP, cfg.FSDP, cfg.PIPELINE
    return EngineSettings(
        engine=engine_name(cfg),
        compile=cfg.TRAIN.COMPILE,
        compile_scope=cfg.TRAIN.COMPILE_SCOPE,
        reduce_in_compute_dtype=cfg.AMP.REDUCE_DTYPE == "compute",
        sync_batch_norm=cfg.BN.SYNC,
        float8=cfg.AMP.FLOAT8,
        float8_min_dim=cfg.AMP.FLOAT8_MIN_DIM,
        ddp=DDPSettings(
            bucket_cap_mb=d.BUCKET_CAP_MB,
            gradient_as_bucket_view=d.GRADIENT_AS_BUCKET_VIEW,
            static_graph=d.STATIC_GRAPH,
            find_unused_parameters=d.FIND_UNUSED_PARAMETERS,
        ),
        fsdp=FSDPSettings(reshard_after_forward=f.RESHARD_AFTER_FORWARD, cpu_offload=f.CPU_OFFLOAD),
        pipeline=PipelineSettings(
            stages=p.STAGES,
            stages_per_rank=p.STAGES_PER_RANK,
            balance=p.BALANCE,
            micro_batches=p.MICRO_BATCHES,
            schedule=p.SCHEDULE,
        ),
    )


def launch_settings(cfg):
    """The LaunchSettings of NUM_PROCS, CPU_THREADS, DEVICE and the engine's needs."""
    engine, p = engine_name(cfg), cfg.PIPELINE
    return LaunchSettings(
        num_procs=cfg.NUM_PROCS,
        cpu_threads=cfg.CPU_THREADS,
        device=cfg.DEVICE,
        engine=engine,
        cpu_collectives=engine == "fsdp" and cfg.FSDP.CPU_OFFLOAD,
        depth=cfg.VIT.DEPTH,
        train_batch_size=cfg.TRAIN.BATCH_SIZE,
        test_batch_size=cfg.TEST.BATCH_SIZE,
        pipeline_stages=p.STAGES,
        pipeline_stages_per_rank=p.STAGES_PER_RANK,
        pipeline_micro_batches=p.MICRO_BATCHES,
        pipeline_schedule=p.SCHEDULE,
    )


def build_lr_schedule(cfg, global_batch_size=None):
    """The schedule that OPTIM describes, with the linear scaling rule applied if configured."""
    o = cfg.OPTIM
    scale = 1.0
    if o.LR_SCALE_BATCH > 0:
        scale = (global_batch_size or cfg.TRAIN.BATCH_SIZE) / o.LR_SCALE_BATCH
    return LRSchedule(
        base_lr=o.BASE_LR * scale,
        min_lr=o.MIN_LR * scale,
        max_epoch=o.MAX_EPOCH,
        policy=o.LR_POLICY,
        steps=o.STEPS,
        lr_mult=o.LR_MULT,
        warmup_epochs=o.WARMUP_EPOCHS,
        warmup_factor=o.WARMUP_FACTOR,
        onecycle_pct_start=o.ONECYCLE_PCT_START,
        onecycle_div_factor=o.ONECYCLE_DIV_FACTOR,
        cycle_epochs=o.CYCLE_EPOCHS,
    )


def build_image_size_schedule(cfg, world_size=1):
    """The training image size (and batch) per epoch: fixed, or CURRICULUM's."""
    c, t = cfg.CURRICULUM, cfg.TRAIN
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


def build_mixer(cfg):
    """The BatchMixer MIXUP describes (mixup / cutmix with soft targets; a no-op at alpha 0)."""
    m = cfg.MIXUP
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
    return TrainingStep(
        engine,
        optimizer,
        scaler,
        loss_fn,
        accum_steps=cfg.TRAIN.ACCUM_STEPS,
        clip_grad=cfg.OPTIM.CLIP_GRAD,
        mixer=build_mixer(cfg),
        ema=build_ema(cfg, engine.module),
        teacher=teacher,
    )


# ------------------------------------------------------------------------------------------------ #
# Models from checkpoints, and the distillation teacher
# ------------------------------------------------------------------------------------------------ #


def model_from_checkpoint(path: str):
    """(model, cfg) from a pycls checkpoint file or folder, or a pycls safetensors file (the
    model built from the config stored inside, with the stored weights). A run folder or its
    checkpoints/ folder stands for its newest checkpoint."""
    path = resume.find_checkpoint(path, "checkpoint")
    if path.endswith(".safetensors"):
        meta = weight_files.read_metadata(path) if os.path.isfile(path) else {}
        cfg_text = meta.get("cfg")
        if not cfg_text:
            raise weight_files.WeightsError(
                f"{path} holds no pycls config (metadata 'cfg'); cannot rebuild"
            )
    else:
        cfg_text = sharded.read_state(path).get("cfg")
        if not cfg_text:
            raise weight_files.WeightsError(f"{path} holds no config; cannot rebuild its model")
    cfg = config.cfg_from_yaml_text(cfg_text)
    model = build_model(cfg)
    if path.endswith(".safetensors"):
        weight_files.load_weights(path, model, "pycls", new_head=False)
    else:
        sharded.load_model_weights(path, model)  # a file or a sharded folder
    return model.eval(), cfg


def _timm_teacher(name, weights, num_classes):
    """A timm model with a weights file (a state dict, possibly under "model"), as DeiT loads
    its RegNetY-160 teacher."""
    import timm  # optional: only timm teachers need it

    try:
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    except RuntimeError as e:  # timm's "Unknown model"
        raise ConfigError(f"DISTILL.TEACHER: timm:{name}: {e}") from None
    state = weight_files.read_state_dict(weights, "DISTILL.TEACHER_WEIGHTS")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        msg = f"DISTILL.TEACHER_WEIGHTS: {weights} does not fit timm:{name}: {first}"
        raise ConfigError(msg) from None
    return model


def build_teacher_module(cfg):
    """The network DISTILL.TEACHER names, with its weights, on the CPU in fp32."""
    d = cfg.DISTILL
    source, weights = d.TEACHER, d.TEACHER_WEIGHTS
    if source.startswith(TEACHER_ZOO):
        name = source[len(TEACHER_ZOO) :]
        try:
            return zoo.build_model(name, weights or True, cache_dir=cfg.MODEL.ZOO_DIR or None)
        except (ValueError, zoo.PretrainedWeightsUnavailable) as e:
            raise ConfigError(f"DISTILL.TEACHER: {e}") from None
    if source.startswith(TEACHER_TIMM):
        return _timm_teacher(source[len(TEACHER_TIMM) :], weights, cfg.MODEL.NUM_CLASSES)
    if not os.path.exists(source):
        raise ConfigError(
            f"DISTILL.TEACHER: {source} does not exist (a pycls checkpoint, or zoo:NAME, timm:NAME)"
        )
    try:
        return model_from_checkpoint(source)[0]
    except UserError as e:  # not a checkpoint, no config inside, weights that do not fit
        raise ConfigError(f"DISTILL.TEACHER: {e}") from None


def build_teacher(cfg, device, precision):
    """The Teacher DISTILL describes: every process holds all of it on ``device``, cast for the
    AMP level (``precision``), compiled with TRAIN.COMPILE."""
    module = build_teacher_module(cfg)
    classes = getattr(module, "num_classes", None)
    if classes != cfg.MODEL.NUM_CLASSES:
        raise ConfigError(
            f"DISTILL.TEACHER: {cfg.DISTILL.TEACHER} predicts {classes} classes, the model "
            f"MODEL.NUM_CLASSES={cfg.MODEL.NUM_CLASSES}"
        )
    millions = sum(p.numel() for p in module.parameters()) / 1e6
    heads = "the distillation head" if cfg.VIT.DIST_TOKEN else "the one head (no VIT.DIST_TOKEN)"
    logger.info(
        f"distilling ({cfg.DISTILL.TYPE}, alpha {cfg.DISTILL.ALPHA}) from {cfg.DISTILL.TEACHER} "
        f"({type(module).__name__}, {millions:.1f} M parameters) into {heads}; every process "
        "holds the whole teacher, in eval mode"
    )
    return Teacher(module, device, precision, compile=cfg.TRAIN.COMPILE)


# ------------------------------------------------------------------------------------------------ #
# Data
# ------------------------------------------------------------------------------------------------ #


def dataset_name(cfg, train):
    return cfg.TRAIN.DATASET if train else cfg.TEST.DATASET


def normalisation(cfg, train=True):
    """(mean, std) in 0-1 units: DATA.MEAN / DATA.STD if set, else the data set's own."""
    mean, std = DATASET_STATS[dataset_name(cfg, train)]
    return list(cfg.DATA.MEAN) or list(mean), list(cfg.DATA.STD) or list(std)


def augment_preset(cfg, name):
    return DEFAULT_AUGMENT[name] if cfg.TRAIN.AUGMENT == "default" else cfg.TRAIN.AUGMENT


def augment_on_device(cfg, train):
    """Whether batches are augmented on the device (shards backend, DATA_LOADER.AUGMENT_DEVICE)."""
    dl = cfg.DATA_LOADER
    if dl.BACKEND != "shards" or dl.AUGMENT_DEVICE == "cpu":
        return False

    preset = augment_preset(cfg, dataset_name(cfg, train))
    # Policies applied on top of the preset run per sample on the CPU only.
    extras = cfg.TRAIN.get("AUTO_AUGMENT", "none") != "none" or cfg.TRAIN.get("RANDOM_ERASING", 0)
    supported = preset in DEVICE_PRESETS and not extras
    cuda = dist.resolve_device(cfg.DEVICE).type == "cuda"
    if dl.AUGMENT_DEVICE == "auto":
        return cuda and supported
    if not cuda:
        raise ConfigError("DATA_LOADER.AUGMENT_DEVICE: 'gpu' needs a CUDA device; DEVICE is cpu")
    if not supported:
        raise ConfigError(
            f"DATA_LOADER.AUGMENT_DEVICE: 'gpu' runs the presets {list(DEVICE_PRESETS)} without "
            f"TRAIN.AUTO_AUGMENT or TRAIN.RANDOM_ERASING, not {preset!r} with those; use cpu"
        )
    return True


def _shard_dataset(cfg, name, split, decode):
    path = cfg.DATA_LOADER.SHARD_PATH
    if not path:
        raise ConfigError("DATA_LOADER.SHARD_PATH: BACKEND shards needs the folder of the shards")
    try:
        base = ShardDataset(path, split, decode=decode, skip_corrupt=cfg.DATA_LOADER.SKIP_CORRUPT,
                            max_pixels=cfg.DATA_LOADER.MAX_IMAGE_PIXELS)  # fmt: skip
    except FileNotFoundError as e:
        raise ConfigError(f"DATA_LOADER.SHARD_PATH: {e}") from None
    if base.dataset != name:
        raise ConfigError(
            f"DATA_LOADER.SHARD_PATH: {base.folder} holds {base.dataset!r} shards, but the "
            f"config asks for {name!r} (TRAIN.DATASET / TEST.DATASET)"
        )
    return base


def _raw_dataset(cfg, name, split, image_size):
    try:
        return datasets.build_dataset(
            name,
            split=split,
            root=cfg.DATA.PATH,
            image_size=image_size,
            num_classes=cfg.MODEL.NUM_CLASSES,
            num_samples=cfg.TRAIN.BATCH_SIZE * 8 if name == "synthetic" else 0,
            max_pixels=cfg.DATA_LOADER.MAX_IMAGE_PIXELS,
        )
    except FileNotFoundError as e:  # a path the user gave: one line naming the key
        raise ConfigError(f"DATA.PATH: {e} ({name}, split {split!r})") from None


def _log_split(cfg, base, name, split, train):
    """One line per split saying what was found; a head wider than the training classes trains
    outputs no label ever asks for, which is allowed (fine-tuning later) but rarely meant."""
    n_classes = getattr(base, "num_classes", None)
    where = f" in {base.folder}" if getattr(base, "folder", None) else ""
    logger.info(f"data {name} {split}: {len(base)} images, {n_classes} classes{where}")
    if train and n_classes is not None and n_classes < cfg.MODEL.NUM_CLASSES:
        logger.warning(
            f"MODEL.NUM_CLASSES {cfg.MODEL.NUM_CLASSES} exceeds the {n_classes} classes of "
            f"{name} ({split}): the extra outputs are never a label; set MODEL.NUM_CLASSES "
            f"{n_classes} unless that is meant"
        )


def build_dataset(cfg, train):
    """The augmented dataset for training (train=True) or evaluation, addressed by sampler keys."""
    name = dataset_name(cfg, train)
    split = cfg.TRAIN.SPLIT if train else cfg.TEST.SPLIT
    image_size = cfg.TRAIN.IM_SIZE if train else cfg.TEST.IM_SIZE
    on_device = augment_on_device(cfg, train)
    if cfg.DATA_LOADER.BACKEND == "shards":
        # JPEG shards stay encoded when the device decodes them.
        base = _shard_dataset(cfg, name, split, decode=not on_device)
    else:
        base = _raw_dataset(cfg, name, split, image_size)
    if cfg.DATA.CLASSES:
        base = ClassSubset(base, list(cfg.DATA.CLASSES))
    n_classes = getattr(base, "num_classes", None)
    if n_classes is not None and n_classes > cfg.MODEL.NUM_CLASSES:
        raise ConfigError(
            f"MODEL.NUM_CLASSES: {cfg.MODEL.NUM_CLASSES} is fewer than the {n_classes} classes "
            f"of {name} ({split})"
        )
    _log_split(cfg, base, name, split, train)
    preset = augment_preset(cfg, name)
    if on_device:
        skip = cfg.DATA_LOADER.SKIP_CORRUPT
        return DeviceAugmentDataset(base, DeviceAugment(preset, train), train, skip_corrupt=skip)
    t = cfg.TRAIN
    factory = functools.partial(
        build_transform,
        preset,
        auto_augment=t.AUTO_AUGMENT,
        rand_augment_n=t.RAND_AUGMENT_N,
        rand_augment_m=t.RAND_AUGMENT_M,
        random_erasing=t.RANDOM_ERASING,
    )
    return AugmentedDataset(base, factory, train, skip_corrupt=cfg.DATA_LOADER.SKIP_CORRUPT)


def per_process_batch(global_batch, what):
    world = dist.get_world_size()
    if global_batch % world:
        raise ConfigError(f"{what}: {global_batch} is not divisible by the {world} processes")
    return global_batch // world


def build_loader(cfg, train, dataset=None, batch_size=None):
    """The DataLoader of this process's shard (uint8 batches, seeded sampler); for on-device
    augmentation, batches of stored bytes and per-sample parameters instead."""

    dataset = dataset if dataset is not None else build_dataset(cfg, train)
    split = "TRAIN" if train else "TEST"
    # batch_size: a global batch other than the config's (the curriculum's batch scaling)
    batch = per_process_batch(batch_size or cfg[split].BATCH_SIZE, f"{split}.BATCH_SIZE")
    if train:  # the loader yields micro-batches; ACCUM_STEPS of them make one optimizer step
        batch //= cfg.TRAIN.ACCUM_STEPS
    dl = cfg.DATA_LOADER
    on_device = isinstance(dataset, DeviceAugmentDataset)
    construct = construct_device_loader if on_device else construct_loader
    return construct(
        dataset,
        batch_size=batch,
        shuffle=train,
        drop_last=train,
        num_workers=dl.NUM_WORKERS,
        pin_memory=dl.PIN_MEMORY,
        persistent_workers=dl.PERSISTENT_WORKERS,
        prefetch_factor=dl.PREFETCH_FACTOR,
        seed=cfg.RNG_SEED,
        image_size=cfg[split].IM_SIZE,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        skip_corrupt=dl.SKIP_CORRUPT,
        repeats=cfg.TRAIN.REPEATED_AUG if train else 1,
    )


def device_batches(cfg, loader, device, train):
    """Wraps a loader so batches arrive on the device, normalised (and augmented there when the
    loader's dataset defers augmentation to the device), as float (channels_last when the model
    is, see MODEL.MEMORY_FORMAT)."""

    mean, std = normalisation(cfg, train)
    cl = channels_last(cfg, device)
    if isinstance(loader.dataset, DeviceAugmentDataset):
        return DeviceAugmentBatches(loader, device, mean, std, loader.dataset.augment, cl)
    return DeviceBatches(loader, device, mean, std, cl)
