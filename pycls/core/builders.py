"""Builders: the only place where the config becomes constructor arguments.

Models, losses, datasets and loaders take explicit arguments; these functions read the config and
pass them on, so library code never depends on the process-wide config.
"""

import functools
import math
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
from pycls.core.schedules import (
    FixedImageSize,
    ImageSizeCurriculum,
    LRSchedule,
    PatchDropSchedule,
)
from pycls.core.training_step import TrainingStep
from pycls.datasets import (
    DATASET_STATS,
    DEFAULT_AUGMENT,
    AugmentedDataset,
    DeviceBatches,
    build_transform,
    construct_loader,
    data_sources,
)
from pycls.datasets.gpu_augment import (
    DEVICE_PRESETS,
    DeviceAugment,
    DeviceAugmentBatches,
    DeviceAugmentDataset,
    construct_device_loader,
)
from pycls.datasets.parquet_shards import ParquetShards
from pycls.datasets.shards import ShardDataset
from pycls.datasets.subset import ClassSubset
from pycls.datasets.tar_shards import TarShards, read_info
from pycls.datasets.token_batches import (
    TokenBatchMixer,
    TokenBudgetDataset,
    TokenBudgetSampler,
    TokenDeviceBatches,
    construct_token_loader,
)
from pycls.datasets.transforms import BatchMixer
from pycls.distributed.preflight import LaunchSettings
from pycls.engines import (
    DDPSettings,
    EngineSettings,
    FSDPSettings,
    MeshSettings,
    PipelineSettings,
    Precision,
)
from pycls.errors import UserError
from pycls.models import zoo
from pycls.models.anynet import AnyNet
from pycls.models.effnet import EffNet
from pycls.models.regnet import RegNet
from pycls.models.resnet import ResNet
from pycls.models.token_masks import computed_tokens, has_flex_attention
from pycls.models.vit import VisionTransformer
from pycls.optim import OptimizerSettings, optimizer_from_settings

logger = logs.get_logger(__name__)

# ------------------------------------------------------------------------------------------------ #
# Models: each family's constructor arguments, one line each, read from the config
# ------------------------------------------------------------------------------------------------ #


def packed_attention(c):
    """VIT.PACKED_ATTENTION, "auto" resolved: FlexAttention's block masks where they skip work
    (CUDA, compiled blocks) and nothing rules them out (attention dropout, drop-path skip); the
    SDPA boolean mask otherwise."""
    v = c.VIT
    cuda = dist.resolve_device(c.DEVICE).type == "cuda"
    if v.PACKED_ATTENTION == "flex" and not cuda:  # DEVICE auto found no GPU
        raise ConfigError(
            "VIT.PACKED_ATTENTION: flex cannot be used with DEVICE cpu: FlexAttention has no "
            "backward pass on the CPU; use sdpa"
        )
    if v.PACKED_ATTENTION != "auto":
        return v.PACKED_ATTENTION
    skip = v.DROP_PATH_MODE == "skip" and v.DROP_PATH > 0
    usable = has_flex_attention() and v.ATTN_DROPOUT == 0 and not skip
    return "flex" if cuda and c.TRAIN.COMPILE and usable else "sdpa"


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
    "patch_drop": lambda c: c.VIT.PATCH_DROP,
    "drop_path_mode": lambda c: c.VIT.DROP_PATH_MODE,
    "packed_attention": packed_attention,
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
    """The EngineSettings of TRAIN.PARALLEL (FSDP.BACKEND), DDP.*, FSDP.*, PIPELINE.*, MESH.*,
    AMP.REDUCE_DTYPE, AMP.FLOAT8(_MIN_DIM), TRAIN.COMPILE(_SCOPE) and BN.SYNC."""
    d, f, p, m = cfg.DDP, cfg.FSDP, cfg.PIPELINE, cfg.MESH
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
        mesh=MeshSettings(
            dp=m.DP,
            tp=m.TP,
            pp=m.PP,
            batch_size=cfg.TRAIN.BATCH_SIZE,
            accum_steps=cfg.TRAIN.ACCUM_STEPS,
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
        cpu_collectives=engine in ("fsdp", "tensor") and cfg.FSDP.CPU_OFFLOAD,
        depth=cfg.VIT.DEPTH,
        train_batch_size=cfg.TRAIN.BATCH_SIZE,
        test_batch_size=cfg.TEST.BATCH_SIZE,
        accum_steps=cfg.TRAIN.ACCUM_STEPS,
        pipeline_stages=p.STAGES,
        pipeline_stages_per_rank=p.STAGES_PER_RANK,
        pipeline_micro_batches=p.MICRO_BATCHES,
        pipeline_schedule=p.SCHEDULE,
        mesh_dp=cfg.MESH.DP,
        mesh_tp=cfg.MESH.TP,
        mesh_pp=cfg.MESH.PP,
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
    return TrainingStep(
        engine,
        optimizer,
        scaler,
        loss_fn,
        accum_steps=cfg.TRAIN.ACCUM_STEPS,
        clip_grad=cfg.OPTIM.CLIP_GRAD,
        mixer=build_mixer(cfg),
        ema=build_ema(cfg, engine.module),
        count_tokens=build_token_counter(cfg, engine.module),
        teacher=teacher,
    )


def build_token_counter(cfg, module):
    """For a ViT, the function counting the token positions its blocks compute per micro-batch
    (the meters' tokens/s and tokens per image); None for the CNNs."""
    if cfg.MODEL.TYPE != "vit":
        return None
    return functools.partial(computed_tokens, module)


# ------------------------------------------------------------------------------------------------ #
# Models from checkpoints, and the distillation teacher
# ------------------------------------------------------------------------------------------------ #


def model_from_checkpoint(path: str):
    """(model, cfg) from a pycls checkpoint file or folder, or a pycls safetensors file (the
    model built from the config stored inside, with the stored weights, once the file is seen to
    hold that model: ``check_claimed_model``). A run folder or its checkpoints/ folder stands for
    its newest checkpoint."""
    path = resume.find_checkpoint(path, "checkpoint")
    if path.endswith(".safetensors"):
        meta = weight_files.read_metadata(path) if os.path.isfile(path) else {}
        cfg_text = meta.get("cfg")
        if not cfg_text:
            raise weight_files.WeightsError(
                f"{path} holds no pycls config (metadata 'cfg'); cannot rebuild"
            )
        shapes = weight_files.stored_shapes(path)
    else:
        state = sharded.read_state(path)
        cfg_text = state.get("cfg")
        if not cfg_text:
            raise weight_files.WeightsError(f"{path} holds no config; cannot rebuild its model")
        shapes = sharded.stored_model_shapes(path, state)
    cfg = config.cfg_from_yaml_text(cfg_text)
    check_claimed_model(path, cfg, shapes)
    model = build_model(cfg)
    if path.endswith(".safetensors"):
        weight_files.load_weights(path, model, "pycls", new_head=False)
    else:
        sharded.load_model_weights(path, model)  # a file or a sharded folder
    return model.eval(), cfg


def _claimed_blocks(cfg):
    """The blocks the config's model has, from its keys alone; each holds at least one tensor
    (a ResNet's depth is looked up in a table, so it bounds itself)."""
    family = cfg.MODEL.TYPE
    if family == "vit":
        return cfg.VIT.DEPTH
    if family == "regnet":
        return cfg.REGNET.DEPTH
    if family == "anynet":
        return sum(cfg.ANYNET.DEPTHS)
    if family == "effnet":
        return sum(cfg.EN.DEPTHS)
    return 0


def check_claimed_model(path, cfg, shapes):
    """Raises WeightsError unless the model that ``cfg`` (a config stored in ``path``) describes
    fits in the tensors the file holds (``shapes``: name -> shape, read from its headers): its
    blocks at most the file's tensors, its values at most the file's. The model is counted on
    the meta device (no storage), so a few-KB file whose config claims billions of parameters
    is refused before they are allocated."""
    held = sum(math.prod(shape) for shape in shapes.values())
    where = f"{path}: its stored config describes"
    if _claimed_blocks(cfg) > len(shapes):
        raise weight_files.WeightsError(
            f"{where} {_claimed_blocks(cfg)} blocks; the file holds {len(shapes)} tensors "
            "(a config that does not belong to these weights, or a crafted file)"
        )
    with torch.device("meta"):
        claimed = build_model(cfg)
    needed = sum(t.numel() for t in claimed.state_dict().values())
    if needed > held:
        raise weight_files.WeightsError(
            f"{where} a model of {needed:,} values; the file holds {held:,} "
            "(a config that does not belong to these weights, or a crafted file): nothing built"
        )


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
    if train and cfg.TRAIN.TOKEN_BUDGET > 0:
        return False  # each image at its own size, on the CPU ("gpu" is refused at load)

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


def sharded_files(cfg, train):
    """(the path the user gave, its key, the files of this split) of BACKEND wds or parquet."""
    d, fmt = cfg.DATA, cfg.DATA_LOADER.BACKEND
    split = cfg.TRAIN.SPLIT if train else cfg.TEST.SPLIT
    own = not train and d.TEST_PATH != ""
    path, key = (d.TEST_PATH, "DATA.TEST_PATH") if own else (d.PATH, "DATA.PATH")
    if (
        not train
        and not own
        and (data_sources.is_pattern(path) or data_sources.format_of_name(path))
    ):
        raise ConfigError(
            f"DATA.TEST_PATH: DATA.PATH {path} names the training split's shards only; give the "
            f"evaluation split's ({split}) in DATA.TEST_PATH"
        )
    try:
        return path, key, data_sources.split_files(path, split, fmt, whole=train or own)
    except data_sources.DataSourceError as e:
        raise ConfigError(f"{key}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot list {path}: {e}") from None


def _sharded_dataset(cfg, train):
    """The tar shards (BACKEND wds) or parquet files (parquet) of this split."""
    dl = cfg.DATA_LOADER
    path, key, files = sharded_files(cfg, train)
    common = dict(max_pixels=dl.MAX_IMAGE_PIXELS, retries=dl.RETRIES, where=path)
    if dl.BACKEND == "wds":
        info = read_info(data_sources.info_file(files, path), dl.RETRIES)
        base = TarShards(files, cache_dir=dl.INDEX_CACHE or None, info=info, **common)
        what = "WebDataset tar shards"
    else:
        base = ParquetShards(files, **common)
        what = "parquet files"
    order = "read in file order"
    if train:
        buffer = f", buffer {dl.SHUFFLE_BUFFER}" if dl.ORDER != "global" else ""
        order = f"epoch order {dl.ORDER}{buffer}"
    logger.info(f"{key} {path}: {len(files)} {what} ({files[0]} ...); {order}")
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
    elif cfg.DATA_LOADER.BACKEND in ("wds", "parquet"):
        base = _sharded_dataset(cfg, train)
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
    if train and cfg.TRAIN.TOKEN_BUDGET > 0:
        return build_token_loader(cfg, dataset)
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
        order=dl.ORDER,
        shuffle_buffer=dl.SHUFFLE_BUFFER,
    )


def device_batches(cfg, loader, device, train):
    """Wraps a loader so batches arrive on the device, normalised (and augmented there when the
    loader's dataset defers augmentation to the device), as float (channels_last when the model
    is, see MODEL.MEMORY_FORMAT)."""

    mean, std = normalisation(cfg, train)
    cl = channels_last(cfg, device)
    if isinstance(loader.dataset, TokenBudgetDataset):
        return TokenDeviceBatches(loader, device, mean, std)
    if isinstance(loader.dataset, DeviceAugmentDataset):
        return DeviceAugmentBatches(loader, device, mean, std, loader.dataset.augment, cl)
    return DeviceBatches(loader, device, mean, std, cl)


# ------------------------------------------------------------------------------------------------ #
# Token budget (TRAIN.TOKEN_BUDGET): variable grids, padded or packed
# ------------------------------------------------------------------------------------------------ #


def num_prefix_tokens(cfg):
    """The ViT's class and register tokens per image."""
    v = cfg.VIT
    return int(v.CLASSIFIER == "token" or v.CLASS_TOKEN) + v.NUM_REGISTERS


def token_sizes(cfg):
    return list(cfg.TRAIN.TOKEN_SIZES) or [cfg.TRAIN.IM_SIZE]


def token_budget_images(cfg):
    """The images at TRAIN.IM_SIZE that TRAIN.TOKEN_BUDGET holds: the batch the learning rate is
    scaled with."""
    return max(1, cfg.TRAIN.TOKEN_BUDGET // (cfg.TRAIN.IM_SIZE // cfg.VIT.PATCH_SIZE) ** 2)


def build_token_sampler(cfg, num_samples, rank=None, world_size=None):
    """The TokenBudgetSampler of this process (or of ``rank`` of ``world_size``) over
    ``num_samples`` training images."""
    t = cfg.TRAIN
    world = dist.get_world_size() if world_size is None else world_size
    shares = world * t.ACCUM_STEPS
    if t.TOKEN_BUDGET % shares:
        raise ConfigError(
            f"TRAIN.TOKEN_BUDGET: {t.TOKEN_BUDGET} patch tokens do not split evenly into the "
            f"{world} processes x TRAIN.ACCUM_STEPS {t.ACCUM_STEPS} micro-batches of a step"
        )
    try:
        sampler = TokenBudgetSampler(
            num_samples,
            seed=cfg.RNG_SEED,
            patch_size=cfg.VIT.PATCH_SIZE,
            sizes=token_sizes(cfg),
            budget=t.TOKEN_BUDGET // shares,
            max_aspect=t.TOKEN_MAX_ASPECT,
            min_scale=t.TOKEN_MIN_SCALE,
            pack=t.TOKEN_PACKING,
            num_prefix=num_prefix_tokens(cfg),
            rank=dist.get_rank() if rank is None else rank,
            world_size=world,
            accum=t.ACCUM_STEPS,
            repeats=t.REPEATED_AUG,
        )
    except ValueError as e:
        raise ConfigError(f"TRAIN.TOKEN_BUDGET: {e}") from None
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"TRAIN.TOKEN_BUDGET: {t.TOKEN_BUDGET} patch tokens per step take more than the "
            f"{num_samples} training images (no full step to train on)"
        )
    return sampler


def build_token_loader(cfg, dataset):
    """The training loader of token batches: the sampler's planned micro-batches, each loaded
    and collated by one worker."""
    if not isinstance(dataset, AugmentedDataset):
        raise ConfigError("TRAIN.TOKEN_BUDGET: token batches are augmented per image on the CPU")
    dl = cfg.DATA_LOADER
    token_dataset = TokenBudgetDataset(
        dataset,
        patch_size=cfg.VIT.PATCH_SIZE,
        num_prefix=num_prefix_tokens(cfg),
        pack=cfg.TRAIN.TOKEN_PACKING,
    )
    return construct_token_loader(
        token_dataset,
        build_token_sampler(cfg, len(dataset)),
        num_workers=dl.NUM_WORKERS,
        pin_memory=dl.PIN_MEMORY,
        persistent_workers=dl.PERSISTENT_WORKERS,
        prefetch_factor=dl.PREFETCH_FACTOR,
        seed=cfg.RNG_SEED,
        skip_corrupt=dl.SKIP_CORRUPT,
    )
