"""The configuration tree: every option pycls understands, its default and what it means.

Only this module, the builders and the tools read the config. Models, layers and datasets take
explicit arguments, so two differently configured models can live in one process.

Use: ``load_cfg(path, overrides)`` merges a YAML file and ``KEY VALUE`` pairs into a fresh copy of
the defaults and validates the result with ``assert_cfg``; a bad key or value raises ``ConfigError``
naming the key (and the allowed values where there is a fixed set).
"""

import math
import os

from yacs.config import CfgNode

_C = CfgNode()
cfg = _C  # the process-wide config that run_net.py fills; library code takes a cfg argument


# ------------------------------------------------------------------------------------------------ #
# Model
# ------------------------------------------------------------------------------------------------ #
_C.MODEL = CfgNode()

# Model family; "vit" is the only one so far (the builder keeps a registry for more)
_C.MODEL.TYPE = "vit"

# A named variant from pycls.models.model_zoo (vit_ti16 ... vit_h14) that fills VIT.PATCH_SIZE,
# VIT.DEPTH, VIT.WIDTH, VIT.NUM_HEADS and VIT.MLP_DIM; "" means those keys are used as written
_C.MODEL.ARCH = ""

# Number of output classes
_C.MODEL.NUM_CLASSES = 1000

# Loss function: "cross_entropy" (with TRAIN.LABEL_SMOOTHING)
_C.MODEL.LOSS_FUN = "cross_entropy"


# ------------------------------------------------------------------------------------------------ #
# Vision Transformer
# ------------------------------------------------------------------------------------------------ #
_C.VIT = CfgNode()

# Patch size in pixels (the stem's total stride); image sizes must be multiples of it
_C.VIT.PATCH_SIZE = 16

# Number of transformer blocks
_C.VIT.DEPTH = 12

# Token width (hidden dimension)
_C.VIT.WIDTH = 768

# Number of attention heads; WIDTH must be divisible by it
_C.VIT.NUM_HEADS = 12

# Hidden dimension of the feed-forward block (4 x WIDTH in the standard variants)
_C.VIT.MLP_DIM = 3072

# Stem: "patchify" (one strided conv) or "conv" (stacked 3x3 convs, "Early convolutions help
# transformers see better")
_C.VIT.STEM_TYPE = "patchify"

# Conv stem only: output channels, kernel sizes and strides of the 3x3 convs (the product of the
# strides must equal PATCH_SIZE); a final 1x1 conv maps to WIDTH
_C.VIT.C_STEM_CHANNELS = [64, 128, 128, 256]
_C.VIT.C_STEM_KERNELS = [3, 3, 3, 3]
_C.VIT.C_STEM_STRIDES = [2, 2, 2, 2]

# Classifier: "token" (class token) or "pooled" (average of the patch tokens, no class token)
_C.VIT.CLASSIFIER = "pooled"

# Token layout through the encoder: "batch_first" (N, L, D) or "batch_second" (L, N, D)
_C.VIT.LAYOUT = "batch_second"

# Feed-forward block: "mlp" (Linear-GELU-Linear) or "local" (Linear, h-swish, 3x3 depthwise conv
# over the token grid, h-swish, Linear)
_C.VIT.FFN = "mlp"

# Position embedding: "learned" or "sincos" (fixed 2-D sine-cosine)
_C.VIT.POS_EMBED = "learned"

# Dropout after the embedding and in the MLP, dropout on the attention weights
_C.VIT.DROPOUT = 0.0
_C.VIT.ATTN_DROPOUT = 0.0

# Stochastic depth: the drop-path rate grows linearly over the blocks up to this value
_C.VIT.DROP_PATH = 0.0

# LayerNorm epsilon
_C.VIT.NORM_EPS = 1e-6

# Activation checkpointing: recompute the first k blocks in the backward pass (saves memory)
_C.VIT.CHECKPOINT_BLOCKS = 0


# ------------------------------------------------------------------------------------------------ #
# Optimizer and learning-rate schedule
# ------------------------------------------------------------------------------------------------ #
_C.OPTIM = CfgNode()

# Optimizer: "sgd", "adamw" or "lamb"
_C.OPTIM.OPTIMIZER = "adamw"

# Learning rate at the end of warmup (for the schedule's reference batch, see OPTIM.LR_SCALE_BATCH)
_C.OPTIM.BASE_LR = 1e-3

# Learning rate the schedule decays to (cosine and linear schedules)
_C.OPTIM.MIN_LR = 1e-5

# Schedule after warmup: "cos", "lin", "steps" or "constant"; updated every iteration
_C.OPTIM.LR_POLICY = "cos"

# "steps" schedule: epochs at which the rate is multiplied by LR_MULT
_C.OPTIM.STEPS = []
_C.OPTIM.LR_MULT = 0.1

# Number of training epochs
_C.OPTIM.MAX_EPOCH = 100

# Warmup: the rate rises linearly from WARMUP_FACTOR * BASE_LR to the schedule over WARMUP_EPOCHS
# (fractional epochs allowed)
_C.OPTIM.WARMUP_EPOCHS = 0.0
_C.OPTIM.WARMUP_FACTOR = 0.01

# Linear LR scaling rule: if > 0, BASE_LR and MIN_LR are for this global batch size and are scaled
# by (global batch / LR_SCALE_BATCH); 0 uses BASE_LR as written
_C.OPTIM.LR_SCALE_BATCH = 0

# SGD momentum, dampening and Nesterov
_C.OPTIM.MOMENTUM = 0.9
_C.OPTIM.DAMPENING = 0.0
_C.OPTIM.NESTEROV = True

# Adam-family betas and epsilon (AdamW and LAMB)
_C.OPTIM.BETAS = [0.9, 0.999]
_C.OPTIM.EPS = 1e-8

# Decoupled weight decay (AdamW, LAMB) or L2 (SGD) for weight matrices
_C.OPTIM.WEIGHT_DECAY = 0.05

# Weight decay for norms, biases, position embedding and class token (0 in every modern recipe)
_C.OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP = 0.0

# Keep parameters and gradients as views into one flat buffer per dtype, so each foreach update is
# a handful of large kernels
_C.OPTIM.CONTIGUOUS_PARAMS = False

# Clip the global gradient norm to this value (0 = no clipping)
_C.OPTIM.CLIP_GRAD = 0.0


# ------------------------------------------------------------------------------------------------ #
# Data
# ------------------------------------------------------------------------------------------------ #
_C.DATA = CfgNode()

# Root folder of the data set ("" for the bundled digits and the synthetic set). For imagefolder
# it holds train/ and val/ (TRAIN.SPLIT, TEST.SPLIT); for cifar10/cifar100, the python pickles
_C.DATA.PATH = ""

# Per-channel normalisation in 0-1 units, applied on the device; empty lists take the data set's
_C.DATA.MEAN = []
_C.DATA.STD = []


# ------------------------------------------------------------------------------------------------ #
# Training
# ------------------------------------------------------------------------------------------------ #
_C.TRAIN = CfgNode()

# Data set: "digits" (bundled), "cifar10", "cifar100", "imagefolder" or "synthetic"
_C.TRAIN.DATASET = "digits"

# Split (sub-folder for imagefolder)
_C.TRAIN.SPLIT = "train"

# Global batch size (split over processes)
_C.TRAIN.BATCH_SIZE = 128

# Training image size (square, pixels)
_C.TRAIN.IM_SIZE = 224

# Augmentation preset: "default" (the data set's own: imagenet, cifar or digits), "imagenet",
# "cifar", "digits" or "none"
_C.TRAIN.AUGMENT = "default"

# Label smoothing of the cross-entropy target
_C.TRAIN.LABEL_SMOOTHING = 0.0

# Evaluate every this many epochs (and always after the last)
_C.TRAIN.EVAL_PERIOD = 1

# Save a checkpoint every this many epochs (and always after the last)
_C.TRAIN.CHECKPOINT_PERIOD = 1

# Resume from the newest checkpoint in OUT_DIR/checkpoints if there is one
_C.TRAIN.AUTO_RESUME = True

# Initialise from these weights (a pycls checkpoint) before training; "" for random init
_C.TRAIN.WEIGHTS = ""

# Parallelism: "none", "ddp", "fsdp" or "pipeline"
_C.TRAIN.PARALLEL = "none"

# Compile the model with torch.compile
_C.TRAIN.COMPILE = False


# ------------------------------------------------------------------------------------------------ #
# Testing
# ------------------------------------------------------------------------------------------------ #
_C.TEST = CfgNode()

# Data set and split for evaluation (same names as TRAIN.DATASET)
_C.TEST.DATASET = "digits"
_C.TEST.SPLIT = "test"

# Global batch size for evaluation
_C.TEST.BATCH_SIZE = 256

# Evaluation image size (square, pixels)
_C.TEST.IM_SIZE = 224

# Weights evaluated by --mode test (a pycls checkpoint)
_C.TEST.WEIGHTS = ""


# ------------------------------------------------------------------------------------------------ #
# Data loader
# ------------------------------------------------------------------------------------------------ #
_C.DATA_LOADER = CfgNode()

# Worker processes per training process (0 loads in the main process)
_C.DATA_LOADER.NUM_WORKERS = 4

# Page-locked host memory for faster, asynchronous host-to-device copies
_C.DATA_LOADER.PIN_MEMORY = True

# Keep workers alive between epochs
_C.DATA_LOADER.PERSISTENT_WORKERS = True

# Batches each worker prepares ahead
_C.DATA_LOADER.PREFETCH_FACTOR = 4

# Skip (and count) unreadable or corrupt images instead of stopping with an error
_C.DATA_LOADER.SKIP_CORRUPT = False


# ------------------------------------------------------------------------------------------------ #
# Mixed precision
# ------------------------------------------------------------------------------------------------ #
_C.AMP = CfgNode()

# Precision level: "O0" fp32; "O1" autocast; "O2" half weights (fp32 norms) + fp32 master weights;
# "O3" everything in half precision
_C.AMP.LEVEL = "O0"

# Half-precision type for O1-O3: "bfloat16" or "float16" (float16 uses dynamic loss scaling)
_C.AMP.DTYPE = "bfloat16"


# ------------------------------------------------------------------------------------------------ #
# Timing (--mode time)
# ------------------------------------------------------------------------------------------------ #
_C.PREC_TIME = CfgNode()

# Untimed warm-up iterations, then timed iterations
_C.PREC_TIME.WARMUP_ITER = 3
_C.PREC_TIME.NUM_ITER = 10


# ------------------------------------------------------------------------------------------------ #
# Miscellaneous
# ------------------------------------------------------------------------------------------------ #

# Device: "auto" (cuda when available, else cpu), "cpu" or "cuda"
_C.DEVICE = "auto"

# Number of local processes to spawn (1 = this process only)
_C.NUM_PROCS = 1

# Output folder for logs, the resolved config, checkpoints and plots
_C.OUT_DIR = "/tmp/pycls"

# Name of the resolved config written to OUT_DIR
_C.CFG_DEST = "config.yaml"

# Seed of every random generator (python, numpy, torch, data order and augmentation)
_C.RNG_SEED = 1

# Log a train_iter json_stats line (and synchronise the device) every this many iterations
_C.LOG_PERIOD = 10

# Deterministic algorithms (cudnn.deterministic, no benchmark): slower, bitwise repeatable
_C.DETERMINISTIC = False


# ------------------------------------------------------------------------------------------------ #
# Validation
# ------------------------------------------------------------------------------------------------ #

# Keys whose value must be one of a fixed set
CHOICES = {
    "MODEL.TYPE": ("vit",),
    "MODEL.LOSS_FUN": ("cross_entropy",),
    "VIT.STEM_TYPE": ("patchify", "conv"),
    "VIT.CLASSIFIER": ("token", "pooled"),
    "VIT.LAYOUT": ("batch_first", "batch_second"),
    "VIT.FFN": ("mlp", "local"),
    "VIT.POS_EMBED": ("learned", "sincos"),
    "OPTIM.OPTIMIZER": ("sgd", "adamw", "lamb"),
    "OPTIM.LR_POLICY": ("cos", "lin", "steps", "constant"),
    "TRAIN.DATASET": ("digits", "cifar10", "cifar100", "imagefolder", "synthetic"),
    "TEST.DATASET": ("digits", "cifar10", "cifar100", "imagefolder", "synthetic"),
    "TRAIN.AUGMENT": ("default", "imagenet", "cifar", "digits", "none"),
    "TRAIN.PARALLEL": ("none", "ddp", "fsdp", "pipeline"),
    "AMP.LEVEL": ("O0", "O1", "O2", "O3"),
    "AMP.DTYPE": ("bfloat16", "float16"),
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
    "TRAIN.IM_SIZE",
    "TRAIN.EVAL_PERIOD",
    "TRAIN.CHECKPOINT_PERIOD",
    "TEST.BATCH_SIZE",
    "TEST.IM_SIZE",
    "DATA_LOADER.PREFETCH_FACTOR",
    "PREC_TIME.NUM_ITER",
    "NUM_PROCS",
    "LOG_PERIOD",
]
NON_NEGATIVE = [
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
    "TRAIN.LABEL_SMOOTHING",
    "DATA_LOADER.NUM_WORKERS",
    "PREC_TIME.WARMUP_ITER",
]

# Validation rules added by other modules (e.g. the sweep or curriculum code): f(cfg) -> None
_EXTRA_CHECKS = []


class ConfigError(ValueError):
    """A config key has a bad value; the message names the key."""


def get(cfg_node, key):
    """Value of a dotted key such as "VIT.PATCH_SIZE"."""
    node = cfg_node
    for part in key.split("."):
        node = node[part]
    return node


def _require(ok, key, msg):
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _check_choices(c):
    for key, allowed in CHOICES.items():
        value = get(c, key)
        _require(value in allowed, key, f"{value!r} is not one of {list(allowed)}")


def _check_ranges(c):
    for key in POSITIVE:
        _require(get(c, key) > 0, key, f"must be > 0, got {get(c, key)!r}")
    for key in NON_NEGATIVE:
        _require(get(c, key) >= 0, key, f"must be >= 0, got {get(c, key)!r}")
    for key in ("VIT.DROPOUT", "VIT.ATTN_DROPOUT", "VIT.DROP_PATH", "TRAIN.LABEL_SMOOTHING"):
        _require(get(c, key) < 1, key, f"must be < 1, got {get(c, key)!r}")


def _check_model(c):
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


def _check_data(c):
    for key in ("DATA.MEAN", "DATA.STD"):
        _require(len(get(c, key)) in (0, 3), key, "needs 0 (data set default) or 3 values")
    _require(all(s > 0 for s in c.DATA.STD), "DATA.STD", "every value must be > 0")
    for split in ("TRAIN", "TEST"):
        key = f"{split}.DATASET"
        if get(c, key) in ("cifar10", "cifar100", "imagefolder"):
            _require(c.DATA.PATH != "", "DATA.PATH", f"{key}={get(c, key)} needs a data folder")


def register_check(fn):
    """Adds a validation rule f(cfg) that raises ConfigError; returns fn (usable as decorator)."""
    _EXTRA_CHECKS.append(fn)
    return fn


def assert_cfg(c=None):
    """Checks every value and combination; raises ConfigError naming the first bad key."""
    c = _C if c is None else c
    for check in (_check_choices, _check_ranges, _check_model, _check_optim, _check_data):
        check(c)
    for check in _EXTRA_CHECKS:
        check(c)


def get_default_cfg():
    """A fresh, mutable copy of the defaults."""
    return _C_DEFAULTS.clone()


def _merge(c, merge_fn, source):
    """Runs a yacs merge and turns its KeyError / ValueError into a ConfigError naming the key."""
    try:
        merge_fn(source)
    except KeyError as e:
        msg = str(e.args[0]) if e.args else str(e)
        key = msg.split(":")[-1].strip()
        raise ConfigError(f"{key}: unknown config key ({msg}); see pycls/core/config.py") from None
    except ValueError as e:
        msg = str(e)
        key = msg.rsplit("config key:", 1)[-1].strip() if "config key:" in msg else "config"
        raise ConfigError(f"{key}: wrong type or value ({msg})") from None
    except AssertionError as e:
        msg = str(e)
        if "Non-existent key:" in msg:  # merge_from_list reports unknown keys this way
            key = msg.split("Non-existent key:")[-1].strip()
            raise ConfigError(f"{key}: unknown config key; see pycls/core/config.py") from None
        raise ConfigError(f"config: {msg}") from None


def _ints_to_floats(defaults, other, prefix=""):
    """yacs refuses 1 for a float key; a researcher writing BASE_LR: 1 means 1.0."""
    for key, value in other.items():
        full = prefix + key
        if key not in defaults:
            continue  # yacs reports the unknown key with its full name
        default = defaults[key]
        if isinstance(default, CfgNode) and isinstance(value, dict):
            _ints_to_floats(default, value, full + ".")
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            other[key] = float(value)


def _merge_file(c, cfg_file):
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"--cfg: config file {cfg_file!r} does not exist")
    with open(cfg_file) as f:
        try:
            other = CfgNode.load_cfg(f)
        except Exception as e:
            raise ConfigError(f"--cfg: cannot parse {cfg_file}: {e}") from None
    _ints_to_floats(c, other)
    _merge(c, c.merge_from_other_cfg, other)


def _merge_list(c, overrides):
    overrides = list(overrides)
    if len(overrides) % 2:
        raise ConfigError(f"overrides: expected KEY VALUE pairs, got an odd list {overrides}")
    for i in range(0, len(overrides), 2):
        key, value = overrides[i], overrides[i + 1]
        try:
            is_float_key = isinstance(get(c, key), float)
        except KeyError:
            is_float_key = False
        if is_float_key and isinstance(value, str) and value.lstrip("+-").isdigit():
            overrides[i + 1] = str(float(value))
    _merge(c, c.merge_from_list, overrides)


def load_cfg(cfg_file=None, overrides=(), validate=True):
    """Defaults <- YAML file <- KEY VALUE overrides, validated; returns a new frozen CfgNode."""
    c = get_default_cfg()
    if cfg_file:
        _merge_file(c, cfg_file)
    _merge_list(c, overrides)
    apply_arch(c)
    if validate:
        assert_cfg(c)
    c.freeze()
    return c


def apply_arch(c):
    """Fills the VIT size keys from MODEL.ARCH when one is named."""
    if not c.MODEL.ARCH:
        return
    from pycls.models.model_zoo import VIT_SPECS

    _require(
        c.MODEL.ARCH in VIT_SPECS,
        "MODEL.ARCH",
        f"{c.MODEL.ARCH!r} is not one of {sorted(VIT_SPECS)}",
    )
    keys = {"patch_size": "PATCH_SIZE", "depth": "DEPTH", "width": "WIDTH"}
    keys.update(num_heads="NUM_HEADS", mlp_dim="MLP_DIM")
    for arg, key in keys.items():
        c.VIT[key] = VIT_SPECS[c.MODEL.ARCH][arg]


def set_global_cfg(c):
    """Copies a loaded config into the process-wide ``cfg`` (used by tools only)."""
    _C.defrost()
    _C.merge_from_other_cfg(c)
    _C.freeze()


def dump_cfg(c, out_dir=None, name=None):
    """Writes the resolved config as YAML to OUT_DIR/CFG_DEST; returns the path."""
    out_dir = c.OUT_DIR if out_dir is None else out_dir
    path = os.path.join(out_dir, name or c.CFG_DEST)
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write(c.dump())
    return path


def cfg_from_yaml_text(text):
    """Rebuilds a config from YAML text (as stored in checkpoints), unvalidated and unfrozen."""
    c = get_default_cfg()
    c.merge_from_other_cfg(CfgNode.load_cfg(text))
    return c


_C_DEFAULTS = _C.clone()
