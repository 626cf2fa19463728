"""Upstream pycls's convolutional families (MODEL.TYPE anynet, regnet, resnet, effnet) under
upstream's keys, names and defaults: their model keys, RESNET, ANYNET, REGNET, EN and BN. What the
keys become is one argument table per family (``ANYNET_ARGS`` ...), checked by the family's own
rules (``pycls.models.cnn.cnn_args``).
"""

from pycls.config.sections.engine import ENGINE_RECORD
from pycls.config.sections.key_checks import CfgNode, check_choices, check_ranges, get, require
from pycls.errors import ConfigError
from pycls.models.cnn.cnn_args import (
    BLOCK_TYPES,
    STEM_TYPES,
    check_anynet_args,
    check_effnet_args,
    check_resnet_args,
    quantized_widths,
)

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.MODEL = CfgNode()
_C.RESNET = CfgNode()
_C.ANYNET = CfgNode()
_C.REGNET = CfgNode()
_C.EN = CfgNode()
_C.BN = CfgNode()

# Number of weight layers of MODEL.TYPE resnet: 50, 101 or 152 on ImageNet-style data; 6n + 2
# (20, 56, 110, ...) when TRAIN.DATASET is cifar10/cifar100 (the CIFAR layout)
_C.MODEL.DEPTH = 0

# Activation of the CNN families: "relu", "silu" (= "swish", EfficientNet's) or "gelu"
_C.MODEL.ACTIVATION_FUN = "relu"

# Apply ReLU in place (saves one activation tensor per layer)
_C.MODEL.ACTIVATION_INPLACE = True

# Memory format of a CNN's weights and input batches: "auto" (channels_last for the CNN families
# on CUDA under TRAIN.PARALLEL none or ddp, where cuDNN's convolutions prefer it; contiguous
# otherwise), "channels_last" or "contiguous". The ViT is always contiguous
_C.MODEL.MEMORY_FORMAT = "auto"

# ---- ResNet / ResNeXt (MODEL.TYPE resnet) ----

# Residual branch: "basic_transform" (two 3x3 convs; the CIFAR layout) or "bottleneck_transform"
# (1x1, 3x3, 1x1; the ImageNet layout)
_C.RESNET.TRANS_FUN = "basic_transform"

# Groups of the 3x3 conv (1 -> ResNet, > 1 -> ResNeXt)
_C.RESNET.NUM_GROUPS = 1

# Width of each group in the first stage (64 -> ResNet, 4 -> ResNeXt 32x4d); doubles per stage
_C.RESNET.WIDTH_PER_GROUP = 64

# Stride on the first 1x1 conv of a bottleneck (MSRA's original) instead of on the 3x3 conv
# (fb.torch, torchvision)
_C.RESNET.STRIDE_1X1 = True

# ---- AnyNet (MODEL.TYPE anynet): stem, stages of blocks, head ----

# Stem: "res_stem_cifar" (3x3 conv), "res_stem_in" (7x7/2 conv + 3x3/2 max-pool) or
# "simple_stem_in" (3x3/2 conv)
_C.ANYNET.STEM_TYPE = "simple_stem_in"

# Stem output width
_C.ANYNET.STEM_W = 32

# Block: "vanilla_block", "res_basic_block", "res_bottleneck_block" or
# "res_bottleneck_linear_block"
_C.ANYNET.BLOCK_TYPE = "res_bottleneck_block"

# Per stage: number of blocks, output width, stride of the first block
_C.ANYNET.DEPTHS = []
_C.ANYNET.WIDTHS = []
_C.ANYNET.STRIDES = []

# Per stage, bottleneck blocks only: bottleneck width / output width, and the group width of the
# 3x3 conv (the bottleneck width must be a multiple of it)
_C.ANYNET.BOT_MULS = []
_C.ANYNET.GROUP_WS = []

# Width of a 1x1 conv in the head before pooling (0 = no conv)
_C.ANYNET.HEAD_W = 0

# Squeeze-and-excitation in the bottleneck blocks, and its width relative to the block's input
_C.ANYNET.SE_ON = False
_C.ANYNET.SE_R = 0.25

# ---- RegNet (MODEL.TYPE regnet): an AnyNet whose widths follow a quantized linear rule ----

# Stem and block types and stem width (as ANYNET.*)
_C.REGNET.STEM_TYPE = "simple_stem_in"
_C.REGNET.STEM_W = 32
_C.REGNET.BLOCK_TYPE = "res_bottleneck_block"

# Stride of every stage
_C.REGNET.STRIDE = 2

# Squeeze-and-excitation (RegNetY) and its ratio
_C.REGNET.SE_ON = False
_C.REGNET.SE_R = 0.25

# Total number of blocks
_C.REGNET.DEPTH = 10

# Initial width (a multiple of 8), slope, and width multiplier between stages: block i would be
# W0 + WA * i wide; widths are snapped to W0 * WM^k and blocks of one width form a stage
_C.REGNET.W0 = 32
_C.REGNET.WA = 5.0
_C.REGNET.WM = 2.5

# Group width of the 3x3 convs
_C.REGNET.GROUP_W = 16

# Bottleneck multiplier (1 / b in the paper)
_C.REGNET.BOT_MUL = 1.0

# Width of a 1x1 conv in the head (0 = none)
_C.REGNET.HEAD_W = 0

# ---- EfficientNet (MODEL.TYPE effnet) ----

# Stem width
_C.EN.STEM_W = 32

# Per stage: blocks, output width, expansion ratio of the MBConv blocks, stride of the first
# block, depthwise kernel size
_C.EN.DEPTHS = []
_C.EN.WIDTHS = []
_C.EN.EXP_RATIOS = []
_C.EN.STRIDES = []
_C.EN.KERNELS = []

# Squeeze-and-excitation width relative to each block's input width
_C.EN.SE_R = 0.25

# Width of the head's 1x1 conv
_C.EN.HEAD_W = 1280

# Drop-connect (stochastic depth) rate of the blocks with a skip, while training
_C.EN.DC_RATIO = 0.0

# Dropout before the classifier
_C.EN.DROPOUT_RATIO = 0.0

# ---- Batch norm (the CNN families) ----

# Epsilon and momentum (PyTorch's convention: the weight of the new batch's statistics)
_C.BN.EPS = 1e-5
_C.BN.MOM = 0.1

# Start the last BN of each residual branch at zero, so each block begins as the identity
_C.BN.ZERO_INIT_FINAL_GAMMA = False

# Precise statistics: before each evaluation, replace every BN's running mean and variance by
# their average over NUM_SAMPLES_PRECISE training images (all processes together, at most one
# pass) with the current weights. Upstream's default is True; here False, so that the ViT's conv
# stem does not change behaviour: the configs in configs/dds_baselines set it
_C.BN.USE_PRECISE_STATS = False
_C.BN.NUM_SAMPLES_PRECISE = 8192

# BN.SYNC is generated from its field of the engine's settings (EngineSettings.sync_batch_norm),
# which names this section as its owner
_ENGINE_KEYS = ENGINE_RECORD.section("model_cnn")
_C.BN.update(_ENGINE_KEYS.tree.BN)
# The generated key's reference text (a hand-written key has its comment above it)
REFERENCE = _ENGINE_KEYS.reference


# ------------------------------------------------------------------------------------------------ #
# Checks (of the CNN families' keys, for a CNN only: a ViT's config ignores them)
# ------------------------------------------------------------------------------------------------ #


class _CnnValues:
    """The value tables of the CNN keys (checked with ``checks.check_choices`` / ``check_ranges``
    for a CNN only)."""

    CHOICES = {
        "MODEL.MEMORY_FORMAT": ("auto", "channels_last", "contiguous"),
        "MODEL.ACTIVATION_FUN": ("relu", "silu", "swish", "gelu"),
        "RESNET.TRANS_FUN": ("basic_transform", "bottleneck_transform"),
        "ANYNET.STEM_TYPE": STEM_TYPES,
        "ANYNET.BLOCK_TYPE": BLOCK_TYPES,
        "REGNET.STEM_TYPE": STEM_TYPES,
        "REGNET.BLOCK_TYPE": BLOCK_TYPES,
    }
    POSITIVE = [
        "ANYNET.STEM_W",
        "REGNET.STEM_W",
        "REGNET.STRIDE",
        "EN.STEM_W",
        "EN.HEAD_W",
        "BN.NUM_SAMPLES_PRECISE",
        "BN.EPS",
    ]
    NON_NEGATIVE = ["ANYNET.HEAD_W", "ANYNET.SE_R", "REGNET.HEAD_W", "REGNET.SE_R", "EN.SE_R"]


# Rates in [0, 1)
CNN_FRACTIONS = ["EN.DC_RATIO", "EN.DROPOUT_RATIO", "BN.MOM"]


def resnet_layout(c):
    """MODEL.TYPE resnet's layout: "cifar" on CIFAR data (as upstream decides), else "imagenet"."""
    return "cifar" if c.TRAIN.DATASET in ("cifar10", "cifar100") else "imagenet"


def check(c):
    if c.MODEL.TYPE == "vit":
        return
    check_choices(c, _CnnValues)
    check_ranges(c, _CnnValues)
    for key in CNN_FRACTIONS:
        require(0 <= get(c, key) < 1, key, f"must be in [0, 1), got {get(c, key)!r}")
    require(
        not (c.BN.SYNC and c.DEVICE == "cpu"),
        "BN.SYNC",
        "SyncBatchNorm needs CUDA (PyTorch has no CPU kernel for it), but DEVICE is cpu",
    )
    _check_family(c)


def _check_family(c):
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
        where = "MODEL.DEPTH / RESNET.* (on TRAIN.DATASET's layout)"
        raise ConfigError(f"{key.get(family, where)}: {e} (MODEL.TYPE {family})") from None


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    "CNN families": ("MODEL.TYPE", lambda c: c.MODEL.TYPE != "vit"),
    "precise BN": ("BN.USE_PRECISE_STATS", lambda c: c.BN.USE_PRECISE_STATS),
    **_ENGINE_KEYS.features,
    "channels_last": (
        "MODEL.MEMORY_FORMAT",
        lambda c: c.MODEL.MEMORY_FORMAT == "channels_last" and c.MODEL.TYPE != "vit",
    ),
}


# ------------------------------------------------------------------------------------------------ #
# What the keys become: each family's constructor arguments, one row per argument. The same table
# builds the model and tells which keys shape it (the resume check)
# ------------------------------------------------------------------------------------------------ #
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
# MODEL.TYPE -> its argument table
ARGUMENT_TABLES = {
    "anynet": ANYNET_ARGS,
    "regnet": REGNET_ARGS,
    "resnet": RESNET_ARGS,
    "effnet": EFFNET_ARGS,
}
