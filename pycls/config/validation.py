"""Which values and combinations of keys are valid: ``assert_cfg`` raises ``ConfigError`` naming
the first bad key (and the allowed values where there is a fixed set)."""

import math

from yacs.config import CfgNode

from pycls.config.defaults import DEFAULTS
from pycls.engines import support
from pycls.errors import ConfigError, require
from pycls.models.anynet import check_anynet_args
from pycls.models.effnet import check_effnet_args
from pycls.models.groups import parse_freeze
from pycls.models.regnet import quantized_widths
from pycls.models.resnet import check_resnet_args
from pycls.models.zoo import ZOO

# Keys whose value must be one of a fixed set
CHOICES = {
    "MODEL.TYPE": ("vit", "anynet", "regnet", "resnet", "effnet"),
    "MODEL.LOSS_FUN": ("cross_entropy",),
    "VIT.STEM_TYPE": ("patchify", "conv"),
    "VIT.CLASSIFIER": ("token", "pooled"),
    "VIT.LAYOUT": ("batch_first", "batch_second"),
    "VIT.FFN": ("mlp", "local"),
    "VIT.POS_EMBED": ("learned", "sincos"),
    "TRAIN.WEIGHTS_FORMAT": ("auto", "pycls", "timm", "torchvision"),
    "OPTIM.OPTIMIZER": ("sgd", "adamw", "lamb", "muon"),
    "MUON.ADJUST_LR": ("match_rms_adamw", "original"),
    "DISTILL.TYPE": ("none", "hard", "soft"),
    "OPTIM.LR_POLICY": ("cos", "lin", "steps", "constant", "onecycle", "cyclic"),
    "TRAIN.DATASET": ("digits", "cifar10", "cifar100", "imagefolder", "synthetic"),
    "TEST.DATASET": ("digits", "cifar10", "cifar100", "imagefolder", "synthetic"),
    "TRAIN.AUGMENT": ("default", "imagenet", "cifar", "digits", "none", "deit", "plain_vit"),
    "TRAIN.AUTO_AUGMENT": ("none", "randaugment", "trivialaugment", "autoaugment"),
    "TRAIN.PARALLEL": ("none", "ddp", "fsdp", "pipeline"),
    "TRAIN.COMPILE_SCOPE": ("blocks", "model"),
    "FSDP.BACKEND": ("torch", "fairscale"),
    "PIPELINE.BALANCE": ("blocks", "params"),
    "PIPELINE.SCHEDULE": ("gpipe", "1f1b", "interleaved_1f1b"),
    "DATA_LOADER.BACKEND": ("torchvision", "shards"),
    "DATA_LOADER.AUGMENT_DEVICE": ("auto", "cpu", "gpu"),
    "AMP.LEVEL": ("O0", "O1", "O2", "O3"),
    "AMP.DTYPE": ("bfloat16", "float16"),
    "AMP.REDUCE_DTYPE": ("float32", "compute"),
    "AMP.CPU_LEVEL": ("auto", "O0", "same"),
    "AMP.FLOAT8": ("none", "tensorwise", "rowwise"),
    "DEVICE": ("auto", "cpu", "cuda"),
}

# Keys whose value must be a positive number (> 0) or non-negative (>= 0)
POSITIVE = [
    "MODEL.NUM_CLASSES",
    "VIT.PATCH_SIZE",
    "VIT.DEPTH",
    "VIT.WIDTH",
    "VIT.NUM_HEADS",
    "VIT.MLP_DIM",
    "OPTIM.MAX_EPOCH",
    "OPTIM.LR_MULT",
    "TRAIN.BATCH_SIZE",
    "TRAIN.ACCUM_STEPS",
    "TRAIN.IM_SIZE",
    "TRAIN.EVAL_PERIOD",
    "TRAIN.CHECKPOINT_PERIOD",
    "TEST.BATCH_SIZE",
    "TEST.IM_SIZE",
    "DATA_LOADER.PREFETCH_FACTOR",
    "PREC_TIME.NUM_ITER",
    "NUM_PROCS",
    "LOG_PERIOD",
    "DDP.BUCKET_CAP_MB",
    "PIPELINE.STAGES",
    "PIPELINE.STAGES_PER_RANK",
    "PIPELINE.MICRO_BATCHES",
    "MUON.LR_MULT",
    "MUON.NS_STEPS",
    "DISTILL.TAU",
]
NON_NEGATIVE = [
    "TRAIN.KEEP_CHECKPOINTS",
    "CPU_THREADS",
    "OPTIM.BASE_LR",
    "OPTIM.MIN_LR",
    "OPTIM.WARMUP_EPOCHS",
    "OPTIM.WARMUP_FACTOR",
    "OPTIM.LR_SCALE_BATCH",
    "OPTIM.MOMENTUM",
    "OPTIM.DAMPENING",
    "OPTIM.EPS",
    "OPTIM.WEIGHT_DECAY",
    "OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP",
    "OPTIM.CLIP_GRAD",
    "VIT.DROPOUT",
    "VIT.ATTN_DROPOUT",
    "VIT.DROP_PATH",
    "VIT.NORM_EPS",
    "VIT.CHECKPOINT_BLOCKS",
    "VIT.NUM_REGISTERS",
    "VIT.HEAD_INIT_SCALE",
    "TRAIN.LABEL_SMOOTHING",
    "DATA_LOADER.NUM_WORKERS",
    "DATA_LOADER.MAX_IMAGE_PIXELS",
    "PREC_TIME.WARMUP_ITER",
    "MUON.WEIGHT_DECAY",
    "MUON.MOMENTUM",
    "AMP.FLOAT8_MIN_DIM",
]


def get(cfg_node, key):
    """Value of a dotted key such as "VIT.PATCH_SIZE"."""
    node = cfg_node
    for part in key.split("."):
        node = node[part]
    return node


_require = require


def _check_finite(c, prefix=""):
    """Every number (and number in a list) is finite: .inf and .nan are never meaningful here."""
    for key, value in c.items():
        full = prefix + key
        if isinstance(value, CfgNode):
            _check_finite(value, full + ".")
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float):
                _require(math.isfinite(v), full, f"must be a finite number, got {value!r}")


def _check_choices(c):
    for key, allowed in CHOICES.items():
        value = get(c, key)
        _require(value in allowed, key, f"{value!r} is not one of {list(allowed)}")


def _check_ranges(c):
    for key in POSITIVE:
        _require(get(c, key) > 0, key, f"must be > 0, got {get(c, key)!r}")
    for key in NON_NEGATIVE:
        _require(get(c, key) >= 0, key, f"must be >= 0, got {get(c, key)!r}")
    for key in (
        "VIT.DROPOUT",
        "VIT.ATTN_DROPOUT",
        "VIT.DROP_PATH",
        "TRAIN.LABEL_SMOOTHING",
        "TRAIN.EMA_DECAY",
        "LRFIND.SMOOTHING",
        "OPTIM.ONECYCLE_PCT_START",
        "MUON.MOMENTUM",
    ):
        _require(get(c, key) < 1, key, f"must be < 1, got {get(c, key)!r}")
    for key in (
        "MIXUP.PROB",
        "MIXUP.SWITCH_PROB",
        "TRAIN.RANDOM_ERASING",
        "TRAIN.EMA_DECAY",
        "OPTIM.ONECYCLE_PCT_START",
        "DISTILL.ALPHA",
    ):
        _require(0 <= get(c, key) <= 1, key, f"must be in [0, 1], got {get(c, key)!r}")


def _check_model(c):
    if c.MODEL.TYPE != "vit":
        return  # the CNN families: _check_cnn
    v = c.VIT
    for key in ("TRAIN.IM_SIZE", "TEST.IM_SIZE"):
        size = get(c, key)
        _require(
            size % v.PATCH_SIZE == 0,
            key,
            f"{size} is not divisible by VIT.PATCH_SIZE={v.PATCH_SIZE}; use a multiple of it",
        )
    _require(
        v.WIDTH % v.NUM_HEADS == 0,
        "VIT.WIDTH",
        f"{v.WIDTH} is not divisible by VIT.NUM_HEADS={v.NUM_HEADS}",
    )
    _require(
        v.CHECKPOINT_BLOCKS <= v.DEPTH,
        "VIT.CHECKPOINT_BLOCKS",
        f"{v.CHECKPOINT_BLOCKS} exceeds VIT.DEPTH={v.DEPTH}",
    )
    if v.STEM_TYPE == "conv":
        n = len(v.C_STEM_CHANNELS)
        _require(
            n > 0 and len(v.C_STEM_KERNELS) == n and len(v.C_STEM_STRIDES) == n,
            "VIT.C_STEM_CHANNELS",
            "VIT.C_STEM_CHANNELS, C_STEM_KERNELS and C_STEM_STRIDES need the same non-zero length",
        )
        _require(
            math.prod(v.C_STEM_STRIDES) == v.PATCH_SIZE,
            "VIT.C_STEM_STRIDES",
            f"product of {list(v.C_STEM_STRIDES)} must equal VIT.PATCH_SIZE={v.PATCH_SIZE}",
        )


def _check_finetune(c):
    o, t, v = c.OPTIM, c.TRAIN, c.VIT
    _require(0 < o.LAYER_DECAY <= 1, "OPTIM.LAYER_DECAY", f"must be in (0, 1], got {o.LAYER_DECAY}")
    try:
        parse_freeze(t.FREEZE, v.DEPTH)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    classes = list(c.DATA.CLASSES)
    _require(
        all(isinstance(k, int) and not isinstance(k, bool) for k in classes),
        "DATA.CLASSES",
        f"must be a flat list of class indices (integers), got {classes}",
    )
    _require(
        len(set(classes)) == len(classes) and all(k >= 0 for k in classes),
        "DATA.CLASSES",
        f"must be distinct class indices >= 0, got {classes}",
    )
    _require(
        len(classes) <= c.MODEL.NUM_CLASSES,
        "DATA.CLASSES",
        f"keeps {len(classes)} classes, more than MODEL.NUM_CLASSES={c.MODEL.NUM_CLASSES}",
    )
    # (OPTIM.LAYER_DECAY with FairScale: the engine x feature rule, pycls.engines.support)


def _check_optim(c):
    o = c.OPTIM
    _require(len(o.BETAS) == 2, "OPTIM.BETAS", f"needs two values, got {list(o.BETAS)}")
    _require(all(0 <= b < 1 for b in o.BETAS), "OPTIM.BETAS", "each beta must be in [0, 1)")
    _require(o.MIN_LR <= o.BASE_LR, "OPTIM.MIN_LR", f"{o.MIN_LR} exceeds BASE_LR={o.BASE_LR}")
    _require(
        list(o.STEPS) == sorted(o.STEPS),
        "OPTIM.STEPS",
        f"must be increasing, got {list(o.STEPS)}",
    )
    if o.LR_POLICY == "steps":
        _require(len(o.STEPS) > 0, "OPTIM.STEPS", "the 'steps' LR_POLICY needs at least one step")
    _require(
        not (o.NESTEROV and o.OPTIMIZER == "sgd" and (o.MOMENTUM <= 0 or o.DAMPENING != 0)),
        "OPTIM.NESTEROV",
        "Nesterov SGD needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING = 0",
    )
    _require(
        not (o.OPTIMIZER == "muon" and c.MODEL.TYPE != "vit"),
        "OPTIM.OPTIMIZER",
        f"muon orthogonalises the 2-D weights of a ViT's blocks; every hidden weight of "
        f"MODEL.TYPE {c.MODEL.TYPE} is a convolution kernel (4-D), which it does not take; use "
        "sgd, adamw or lamb",
    )


# DISTILL.TEACHER's prefixes: a zoo model, a timm model; anything else is a pycls checkpoint
TEACHER_ZOO, TEACHER_TIMM = "zoo:", "timm:"


def _check_distill(c):
    d = c.DISTILL
    if d.TYPE == "none":
        return
    _require(d.TEACHER != "", "DISTILL.TEACHER", f"DISTILL.TYPE {d.TYPE} needs a teacher")
    if d.TEACHER.startswith(TEACHER_ZOO):
        name = d.TEACHER[len(TEACHER_ZOO) :]
        _require(name in ZOO, "DISTILL.TEACHER", f"{name!r} is not in the zoo; one of {list(ZOO)}")
    if d.TEACHER.startswith(TEACHER_TIMM):
        _require(
            d.TEACHER_WEIGHTS != "",
            "DISTILL.TEACHER_WEIGHTS",
            f"the timm teacher {d.TEACHER[len(TEACHER_TIMM) :]} needs its weights file",
        )


def _check_data(c):
    for key in ("DATA.MEAN", "DATA.STD"):
        _require(len(get(c, key)) in (0, 3), key, "needs 0 (data set default) or 3 values")
    _require(all(s > 0 for s in c.DATA.STD), "DATA.STD", "every value must be > 0")
    dl = c.DATA_LOADER
    if dl.BACKEND == "shards":  # prepared shards replace the raw data folder
        _require(dl.SHARD_PATH != "", "DATA_LOADER.SHARD_PATH", "BACKEND shards needs the folder")
    else:
        for split in ("TRAIN", "TEST"):
            key = f"{split}.DATASET"
            if get(c, key) in ("cifar10", "cifar100", "imagefolder"):
                _require(c.DATA.PATH != "", "DATA.PATH", f"{key}={get(c, key)} needs a data folder")
    _require(
        not (dl.AUGMENT_DEVICE == "gpu" and c.DEVICE == "cpu"),
        "DATA_LOADER.AUGMENT_DEVICE",
        "'gpu' needs a CUDA device, but DEVICE is cpu",
    )


# When each feature of the engine x feature rule (pycls.engines.support.FEATURES) is on
FEATURE_ON = {
    "EMA": lambda c: c.TRAIN.EMA,
    "curriculum": lambda c: c.CURRICULUM.ENABLED,
    "accumulation": lambda c: c.TRAIN.ACCUM_STEPS > 1,
    "AMP": lambda c: c.AMP.LEVEL != "O0",
    "LAMB": lambda c: c.OPTIM.OPTIMIZER == "lamb",
    "Muon": lambda c: c.OPTIM.OPTIMIZER == "muon",
    "distillation": lambda c: c.DISTILL.TYPE != "none",
    "float8": lambda c: c.AMP.FLOAT8 != "none",
    "gradient clipping": lambda c: c.OPTIM.CLIP_GRAD > 0,
    "mixup/cutmix": lambda c: c.MIXUP.ALPHA > 0 or c.MIXUP.CUTMIX_ALPHA > 0,
    "contiguous params": lambda c: c.OPTIM.CONTIGUOUS_PARAMS,
    "skip corrupt": lambda c: c.DATA_LOADER.SKIP_CORRUPT,
    "layer decay": lambda c: c.OPTIM.LAYER_DECAY != 1,
    "CNN families": lambda c: c.MODEL.TYPE != "vit",
    "precise BN": lambda c: c.BN.USE_PRECISE_STATS,
    "SyncBatchNorm": lambda c: c.BN.SYNC,
    "compile": lambda c: c.TRAIN.COMPILE,
    "whole-model compile": lambda c: c.TRAIN.COMPILE and c.TRAIN.COMPILE_SCOPE == "model",
    "channels_last": lambda c: c.MODEL.MEMORY_FORMAT == "channels_last" and c.MODEL.TYPE != "vit",
}
assert set(FEATURE_ON) == set(support.FEATURES), "every feature of the rule needs its test here"


def engine_name(c):
    """The engine the config selects (a key of pycls.engines.support.ENGINES)."""
    if c.TRAIN.PARALLEL == "fsdp" and c.FSDP.BACKEND == "fairscale":
        return "fairscale"
    return c.TRAIN.PARALLEL


def _check_engine(c):
    """The engine x feature rule (pycls.engines.support): a pair that cannot work names both."""
    enabled = [feature for feature, on in FEATURE_ON.items() if on(c)]
    for key, msg in support.conflicts(engine_name(c), enabled):
        raise ConfigError(f"{key}: {msg}")


def _check_recipes(c):
    t, cur = c.TRAIN, c.CURRICULUM
    _require(
        t.BATCH_SIZE % t.ACCUM_STEPS == 0,
        "TRAIN.ACCUM_STEPS",
        f"TRAIN.BATCH_SIZE={t.BATCH_SIZE} is not divisible by TRAIN.ACCUM_STEPS={t.ACCUM_STEPS}",
    )
    _require(
        c.LRFIND.START_LR < c.LRFIND.END_LR,
        "LRFIND.END_LR",
        f"{c.LRFIND.END_LR} must exceed LRFIND.START_LR={c.LRFIND.START_LR}",
    )
    if not cur.ENABLED:
        return
    p = c.VIT.PATCH_SIZE if c.MODEL.TYPE == "vit" else 1
    for key in ("CURRICULUM.START_SIZE", "CURRICULUM.STEP"):
        _require(
            get(c, key) % p == 0, key, f"{get(c, key)} is not a multiple of VIT.PATCH_SIZE={p}"
        )
    _require(
        cur.START_SIZE <= t.IM_SIZE,
        "CURRICULUM.START_SIZE",
        f"{cur.START_SIZE} exceeds TRAIN.IM_SIZE={t.IM_SIZE}",
    )


# ---- the convolutional families' keys ---------------------------------------------------------

CNN_CHOICES = {
    "MODEL.MEMORY_FORMAT": ("auto", "channels_last", "contiguous"),
    "MODEL.ACTIVATION_FUN": ("relu", "silu", "swish", "gelu"),
    "RESNET.TRANS_FUN": ("basic_transform", "bottleneck_transform"),
    "ANYNET.STEM_TYPE": ("res_stem_cifar", "res_stem_in", "simple_stem_in"),
    "ANYNET.BLOCK_TYPE": (
        "vanilla_block",
        "res_basic_block",
        "res_bottleneck_block",
        "res_bottleneck_linear_block",
    ),
    "REGNET.STEM_TYPE": ("res_stem_cifar", "res_stem_in", "simple_stem_in"),
    "REGNET.BLOCK_TYPE": (
        "vanilla_block",
        "res_basic_block",
        "res_bottleneck_block",
        "res_bottleneck_linear_block",
    ),
}
CNN_POSITIVE = ["ANYNET.STEM_W", "REGNET.STEM_W", "REGNET.STRIDE", "EN.STEM_W", "EN.HEAD_W"]
CNN_POSITIVE += ["BN.NUM_SAMPLES_PRECISE"]
CNN_NON_NEGATIVE = ["ANYNET.HEAD_W", "ANYNET.SE_R", "REGNET.HEAD_W", "REGNET.SE_R", "EN.SE_R"]
CNN_FRACTIONS = ["EN.DC_RATIO", "EN.DROPOUT_RATIO", "BN.MOM"]


def resnet_layout(c):
    """MODEL.TYPE resnet's layout: "cifar" on CIFAR data (as upstream decides), else "imagenet"."""
    return "cifar" if c.TRAIN.DATASET in ("cifar10", "cifar100") else "imagenet"


def _check_cnn_family(c):
    """The active family's own argument check, its message prefixed with the family's keys."""
    family = c.MODEL.TYPE
    try:
        if family == "anynet":
            a = c.ANYNET
            check_anynet_args(
                a.STEM_TYPE, a.BLOCK_TYPE, a.DEPTHS, a.WIDTHS, a.STRIDES, a.BOT_MULS, a.GROUP_WS
            )
        elif family == "regnet":
            r = c.REGNET
            quantized_widths(r.WA, r.W0, r.WM, r.DEPTH)
        elif family == "resnet":
            r = c.RESNET
            check_resnet_args(resnet_layout(c), c.MODEL.DEPTH, r.TRANS_FUN)
        else:
            e = c.EN
            check_effnet_args(e.DEPTHS, e.WIDTHS, e.EXP_RATIOS, e.STRIDES, e.KERNELS)
    except ValueError as e:
        key = {"anynet": "ANYNET.*", "regnet": "REGNET.*", "effnet": "EN.*"}
        raise ConfigError(f"{key.get(family, 'MODEL.DEPTH / RESNET.*')}: {e}") from None


def _check_zoo_weights(c):
    for key in ("TRAIN.WEIGHTS", "TEST.WEIGHTS"):
        value = get(c, key)
        if value.startswith("zoo:"):
            name = value[len("zoo:") :]
            _require(name in ZOO, key, f"{name!r} is not in the zoo; one of {list(ZOO)}")


def _check_cnn(c):
    _check_zoo_weights(c)
    if c.MODEL.TYPE == "vit":
        return
    for key, allowed in CNN_CHOICES.items():
        value = get(c, key)
        _require(value in allowed, key, f"{value!r} is not one of {list(allowed)}")
    for key in CNN_POSITIVE:
        _require(get(c, key) > 0, key, f"must be > 0, got {get(c, key)!r}")
    for key in CNN_NON_NEGATIVE:
        _require(get(c, key) >= 0, key, f"must be >= 0, got {get(c, key)!r}")
    for key in CNN_FRACTIONS:
        _require(0 <= get(c, key) < 1, key, f"must be in [0, 1), got {get(c, key)!r}")
    _require(c.BN.EPS > 0, "BN.EPS", f"must be > 0, got {c.BN.EPS!r}")
    _require(
        not (c.BN.SYNC and c.DEVICE == "cpu"),
        "BN.SYNC",
        "SyncBatchNorm needs CUDA (PyTorch has no CPU kernel for it), but DEVICE is cpu",
    )
    _check_cnn_family(c)


def assert_cfg(c=None):
    """Checks every value and combination; raises ConfigError naming the first bad key."""
    c = DEFAULTS if c is None else c
    for check in (
        _check_finite,
        _check_choices,
        _check_ranges,
        _check_model,
        _check_optim,
        _check_data,
        _check_recipes,
        _check_distill,
        _check_finetune,
        _check_cnn,
        _check_engine,
    ):
        check(c)
