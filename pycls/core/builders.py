"""Builders: the only place where the config becomes constructor arguments.

Models, losses, datasets and loaders take explicit arguments; these functions read the config and
pass them on, so library code never depends on the process-wide config.
"""

import functools

from torch import nn

from pycls.core import distributed as dist

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
    )


@register_model("vit")
def _build_vit(cfg, image_size=None):
    from pycls.models.vit import VisionTransformer

    return VisionTransformer(**vit_kwargs(cfg, image_size))


def build_model(cfg, image_size=None):
    """The model MODEL.TYPE names, on the CPU in fp32 (the trainer moves and casts it)."""
    return _MODELS[cfg.MODEL.TYPE](cfg, image_size)


def build_loss_fn(cfg):
    """Cross-entropy with label smoothing (accepts class indices or soft targets)."""
    return nn.CrossEntropyLoss(label_smoothing=cfg.TRAIN.LABEL_SMOOTHING)


def model_complexity(cfg, model=None):
    """Params, FLOPs (multiply-adds) and activations per image at TRAIN.IM_SIZE."""
    model = model if model is not None else build_model(cfg)
    return model.complexity(cfg.TRAIN.IM_SIZE)


# ------------------------------------------------------------------------------------------------ #
# Data
# ------------------------------------------------------------------------------------------------ #


def dataset_name(cfg, train):
    return cfg.TRAIN.DATASET if train else cfg.TEST.DATASET


def normalisation(cfg, train=True):
    """(mean, std) in 0-1 units: DATA.MEAN / DATA.STD if set, else the data set's own."""
    from pycls.datasets import DATASET_STATS

    mean, std = DATASET_STATS[dataset_name(cfg, train)]
    return list(cfg.DATA.MEAN) or list(mean), list(cfg.DATA.STD) or list(std)


def augment_preset(cfg, name):
    from pycls.datasets import DEFAULT_AUGMENT

    return DEFAULT_AUGMENT[name] if cfg.TRAIN.AUGMENT == "default" else cfg.TRAIN.AUGMENT


def build_dataset(cfg, train):
    """The augmented dataset for training (train=True) or evaluation, addressed by sampler keys."""
    from pycls.datasets import AugmentedDataset, build_dataset, build_transform

    name = dataset_name(cfg, train)
    split = cfg.TRAIN.SPLIT if train else cfg.TEST.SPLIT
    image_size = cfg.TRAIN.IM_SIZE if train else cfg.TEST.IM_SIZE
    base = build_dataset(
        name,
        split=split,
        root=cfg.DATA.PATH,
        image_size=image_size,
        num_classes=cfg.MODEL.NUM_CLASSES,
        num_samples=cfg.TRAIN.BATCH_SIZE * 8 if name == "synthetic" else 0,
    )
    n_classes = getattr(base, "num_classes", None)
    if n_classes is not None and n_classes > cfg.MODEL.NUM_CLASSES:
        raise ValueError(
            f"MODEL.NUM_CLASSES: {cfg.MODEL.NUM_CLASSES} is fewer than the {n_classes} classes "
            f"of {name} ({split})"
        )
    preset = augment_preset(cfg, name)
    factory = functools.partial(build_transform, preset)
    return AugmentedDataset(base, factory, train, skip_corrupt=cfg.DATA_LOADER.SKIP_CORRUPT)


def per_process_batch(global_batch, what):
    world = dist.get_world_size()
    if global_batch % world:
        raise ValueError(f"{what}: {global_batch} is not divisible by the {world} processes")
    return global_batch // world


def build_loader(cfg, train, dataset=None):
    """The DataLoader of this process's shard (uint8 batches, seeded sampler)."""
    from pycls.datasets import construct_loader

    dataset = dataset if dataset is not None else build_dataset(cfg, train)
    split = "TRAIN" if train else "TEST"
    batch = per_process_batch(cfg[split].BATCH_SIZE, f"{split}.BATCH_SIZE")
    dl = cfg.DATA_LOADER
    return construct_loader(
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
    )


def device_batches(cfg, loader, device, train):
    """Wraps a loader so batches arrive on the device, normalised, as float."""
    from pycls.datasets import DeviceBatches

    mean, std = normalisation(cfg, train)
    return DeviceBatches(loader, device, mean, std)
