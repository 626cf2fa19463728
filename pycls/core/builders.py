"""Builders: the only place where the config becomes constructor arguments.

Models, losses, datasets and loaders take explicit arguments; these functions read the config and
pass them on, so library code never depends on the process-wide config.
"""

import functools

import torch
from torch import nn

from pycls import datasets
from pycls import distributed as dist
from pycls.config import ConfigError, resnet_layout
from pycls.core import logging as logs
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
from pycls.models import zoo
from pycls.models.anynet import AnyNet
from pycls.models.effnet import EffNet
from pycls.models.regnet import RegNet
from pycls.models.resnet import ResNet
from pycls.models.vit import VisionTransformer
from pycls.optim import OptimizerSettings, optimizer_from_settings

logger = logs.get_logger(__name__)

# Model families: MODEL.TYPE -> function(cfg) returning an nn.Module
_MODELS = {}


def register_model(name):
    """Decorator adding a model family builder under MODEL.TYPE ``name``."""

    def wrap(fn):
        _MODELS[name] = fn
        return fn

    return wrap


def vit_kwargs(cfg, image_size=None):
    """The VisionTransformer arguments that cfg describes."""
    v = cfg.VIT
    return dict(
        image_size=image_size or cfg.TRAIN.IM_SIZE,
        patch_size=v.PATCH_SIZE,
        num_classes=cfg.MODEL.NUM_CLASSES,
        depth=v.DEPTH,
        width=v.WIDTH,
        num_heads=v.NUM_HEADS,
        mlp_dim=v.MLP_DIM,
        stem=v.STEM_TYPE,
        conv_stem_channels=tuple(v.C_STEM_CHANNELS),
        conv_stem_kernels=tuple(v.C_STEM_KERNELS),
        conv_stem_strides=tuple(v.C_STEM_STRIDES),
        classifier=v.CLASSIFIER,
        layout=v.LAYOUT,
        ffn=v.FFN,
        pos_embed=v.POS_EMBED,
        dropout=v.DROPOUT,
        attn_dropout=v.ATTN_DROPOUT,
        drop_path=v.DROP_PATH,
        norm_eps=v.NORM_EPS,
        checkpoint_blocks=v.CHECKPOINT_BLOCKS,
        class_token=v.CLASSIFIER == "token" or v.CLASS_TOKEN,
        num_registers=v.NUM_REGISTERS,
        qkv_bias=v.QKV_BIAS,
        pre_norm=v.PRE_NORM,
        fc_norm=v.FC_NORM,
        head_init_scale=v.HEAD_INIT_SCALE,
    )


@register_model("vit")
def _build_vit(cfg, image_size=None):
    return VisionTransformer(**vit_kwargs(cfg, image_size))


# ------------------------------------------------------------------------------------------------ #
# Convolutional model families (upstream pycls's MODEL.TYPE anynet, regnet, resnet, effnet)
# ------------------------------------------------------------------------------------------------ #


# TRAIN.WEIGHTS / TEST.WEIGHTS prefix naming a published zoo model ("zoo:RegNetY-800MF")
ZOO_PREFIX = "zoo:"


def cnn_common_kwargs(cfg):
    """The arguments every CNN family takes: classes, batch norm, activation."""
    return dict(
        num_classes=cfg.MODEL.NUM_CLASSES,
        bn_eps=cfg.BN.EPS,
        bn_momentum=cfg.BN.MOM,
        zero_init_final_gamma=cfg.BN.ZERO_INIT_FINAL_GAMMA,
        activation=cfg.MODEL.ACTIVATION_FUN,
        activation_inplace=cfg.MODEL.ACTIVATION_INPLACE,
    )


def anynet_kwargs(cfg):
    a = cfg.ANYNET
    return dict(
        stem_type=a.STEM_TYPE,
        stem_w=a.STEM_W,
        block_type=a.BLOCK_TYPE,
        depths=tuple(a.DEPTHS),
        widths=tuple(a.WIDTHS),
        strides=tuple(a.STRIDES),
        bot_muls=tuple(a.BOT_MULS),
        group_ws=tuple(a.GROUP_WS),
        head_w=a.HEAD_W,
        se_r=a.SE_R if a.SE_ON else 0.0,
        **cnn_common_kwargs(cfg),
    )


def regnet_kwargs(cfg):
    r = cfg.REGNET
    return dict(
        w_a=r.WA,
        w_0=r.W0,
        w_m=r.WM,
        depth=r.DEPTH,
        group_w=r.GROUP_W,
        bot_mul=r.BOT_MUL,
        stride=r.STRIDE,
        stem_type=r.STEM_TYPE,
        stem_w=r.STEM_W,
        block_type=r.BLOCK_TYPE,
        head_w=r.HEAD_W,
        se_r=r.SE_R if r.SE_ON else 0.0,
        **cnn_common_kwargs(cfg),
    )


def resnet_kwargs(cfg):
    r = cfg.RESNET
    return dict(
        depth=cfg.MODEL.DEPTH,
        layout=resnet_layout(cfg),
        trans_fun=r.TRANS_FUN,
        num_groups=r.NUM_GROUPS,
        width_per_group=r.WIDTH_PER_GROUP,
        stride_1x1=r.STRIDE_1X1,
        **cnn_common_kwargs(cfg),
    )


def effnet_kwargs(cfg):
    e = cfg.EN
    return dict(
        stem_w=e.STEM_W,
        depths=tuple(e.DEPTHS),
        widths=tuple(e.WIDTHS),
        exp_ratios=tuple(e.EXP_RATIOS),
        strides=tuple(e.STRIDES),
        kernels=tuple(e.KERNELS),
        se_r=e.SE_R,
        head_w=e.HEAD_W,
        dc_ratio=e.DC_RATIO,
        dropout_ratio=e.DROPOUT_RATIO,
        **cnn_common_kwargs(cfg),
    )


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


def _sized(model, cfg, image_size):
    """A CNN takes any image size; it records the one it is built for (complexity, engines)."""
    model.set_image_size(image_size or cfg.TRAIN.IM_SIZE)
    return model


@register_model("anynet")
def _build_anynet(cfg, image_size=None):
    return _sized(AnyNet(**anynet_kwargs(cfg)), cfg, image_size)


@register_model("regnet")
def _build_regnet(cfg, image_size=None):
    return _sized(RegNet(**regnet_kwargs(cfg)), cfg, image_size)


@register_model("resnet")
def _build_resnet(cfg, image_size=None):
    return _sized(ResNet(**resnet_kwargs(cfg)), cfg, image_size)


@register_model("effnet")
def _build_effnet(cfg, image_size=None):
    return _sized(EffNet(**effnet_kwargs(cfg)), cfg, image_size)


def build_model(cfg, image_size=None):
    """The model MODEL.TYPE names, on the CPU in fp32 (the trainer moves and casts it)."""
    return _MODELS[cfg.MODEL.TYPE](cfg, image_size)


def build_loss_fn(cfg):
    """Cross-entropy with label smoothing (accepts class indices or soft targets)."""
    return nn.CrossEntropyLoss(label_smoothing=cfg.TRAIN.LABEL_SMOOTHING)


def optimizer_settings(cfg):
    """The OptimizerSettings the OPTIM keys describe (layer decay over the ViT's blocks)."""
    o = cfg.OPTIM
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
    )


def build_optimizer(cfg, model, master_weights=False):
    """The optimizer OPTIM describes, over weight-decay groups built from ``model`` (build it
    after the model is on its device and cast for the AMP level)."""
    return optimizer_from_settings(model, optimizer_settings(cfg), master_weights)


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
