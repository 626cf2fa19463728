"""Which values and combinations of keys are valid: ``assert_cfg`` raises ``ConfigError`` naming
the first bad key (and the allowed values where there is a fixed set)."""

import math
import reprlib

from yacs.config import CfgNode

from pycls.config.defaults import DEFAULTS
from pycls.distributed.mesh import mesh_shape
from pycls.engines import support
from pycls.errors import ConfigError, require
from pycls.models.anynet import check_anynet_args
from pycls.models.effnet import check_effnet_args
from pycls.models.groups import parse_freeze
from pycls.models.regnet import quantized_widths
from pycls.models.resnet import check_resnet_args
from pycls.models.vit.args import tp_divisors
from pycls.models.vit.token_masks import has_flex_attention
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
    "VIT.DROP_PATH_MODE": ("multiply", "skip"),
    "VIT.PATCH_DROP_SCHEDULE": ("constant", "curriculum"),
    "VIT.PACKED_ATTENTION": ("auto", "sdpa", "flex"),
    "TRAIN.WEIGHTS_FORMAT": ("auto", "pycls", "timm", "torchvision"),
    "OPTIM.OPTIMIZER": ("sgd", "adamw", "lamb", "muon"),
    "MUON.ADJUST_LR": ("match_rms_adamw", "original"),
    "DISTILL.TYPE": ("none", "hard", "soft"),
    "OPTIM.LR_POLICY": ("cos", "lin", "steps", "constant", "onecycle", "cyclic"),
    "TRAIN.DATASET": ("digits", "cifar10", "cifar100", "imagefolder", "synthetic"),
    "TEST.DATASET": ("digits", "cifar10", "cifar100", "imagefolder", "synthetic"),
    "TRAIN.AUGMENT": ("default", "imagenet", "cifar", "digits", "none", "deit", "plain_vit"),
    "TRAIN.AUTO_AUGMENT": ("none", "randaugment", "trivialaugment", "autoaugment"),
    "TRAIN.PARALLEL": ("none", "ddp", "fsdp", "pipeline", "tensor"),
    "TRAIN.COMPILE_SCOPE": ("blocks", "model"),
    "FSDP.BACKEND": ("torch", "fairscale"),
    "PIPELINE.BALANCE": ("blocks", "params"),
    "PIPELINE.SCHEDULE": ("gpipe", "1f1b", "interleaved_1f1b"),
    "DATA_LOADER.BACKEND": ("torchvision", "shards", "wds", "parquet"),
    "DATA_LOADER.ORDER": ("auto", "global", "shards", "resampled"),
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
    "DATA_LOADER.RETRIES",
    "PREC_TIME.NUM_ITER",
    "NUM_PROCS",
    "LOG_PERIOD",
    "DDP.BUCKET_CAP_MB",
    "PIPELINE.STAGES",
    "PIPELINE.STAGES_PER_RANK",
    "PIPELINE.MICRO_BATCHES",
    "MESH.TP",
    "MESH.PP",
    "MUON.LR_MULT",
    "MUON.NS_STEPS",
    "DISTILL.TAU",
]
NON_NEGATIVE = [
    "MESH.DP",
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
    "VIT.PATCH_DROP",
    "VIT.PATCH_DROP_OFF_EPOCH",
    "TRAIN.TOKEN_BUDGET",
    "TRAIN.LABEL_SMOOTHING",
    "DATA_LOADER.NUM_WORKERS",
    "DATA_LOADER.MAX_IMAGE_PIXELS",
    "DATA_LOADER.SHUFFLE_BUFFER",
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

# How much of a value an error message shows
_SHOWN_CHARS = 80
# The largest RNG_SEED: numpy seeds take 32 bits, and each process adds its rank
MAX_SEED = 2**31 - 1


_REPR = reprlib.Repr()
_REPR.maxlist = _REPR.maxtuple = 8
_REPR.maxdict, _REPR.maxstring, _REPR.maxother = 4, _SHOWN_CHARS, _SHOWN_CHARS


def show(value):
    """``repr(value)``, shortened for an error message: a list of a hundred thousand values (or
    a string of a megabyte) is named by its start and its length."""
    text = _REPR.repr(value)
    if len(text) > _SHOWN_CHARS:
        text = text[:_SHOWN_CHARS] + "..."
    if isinstance(value, (list, tuple)) and len(value) > 8:
        text += f" ({len(value)} values)"
    return text


def _leaves(c, prefix=""):
    """(dotted key, value) of every key that is not a section."""
    for key, value in c.items():
        if isinstance(value, CfgNode):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_list_items(c):
    """Every list key holds numbers (every list in the key tree does: sizes, strides, steps,
    betas, means, class indices), never lists, mappings, strings, booleans or nulls: one of those
    would otherwise fail later, deep in a model or a comparison, with a traceback."""
    for key, value in _leaves(c):
        if isinstance(value, (list, tuple)):
            bad = [v for v in value if not _is_number(v)]
            if bad:
                raise ConfigError(f"{key}: holds {show(bad[0])}, but its values are numbers")


def _check_finite(c):
    """Every number (and number in a list) is finite: .inf and .nan are never meaningful here."""
    for key, value in _leaves(c):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                where = f" in {show(value)}" if isinstance(value, (list, tuple)) else ""
                raise ConfigError(f"{key}: must be a finite number, got {v!r}{where}")


def _check_choices(c):
    for key, allowed in CHOICES.items():
        value = get(c, key)
        _require(value in allowed, key, f"{show(value)} is not one of {list(allowed)}")


def _check_ranges(c):
    for key in POSITIVE:
        _require(get(c, key) > 0, key, f"must be > 0, got {get(c, key)!r}")
    for key in NON_NEGATIVE:
        _require(get(c, key) >= 0, key, f"must be >= 0, got {get(c, key)!r}")
    _require(
        0 <= c.RNG_SEED <= MAX_SEED, "RNG_SEED", f"must be in [0, {MAX_SEED}], got {c.RNG_SEED}"
    )
    for key in (
        "VIT.DROPOUT",
        "VIT.ATTN_DROPOUT",
        "VIT.DROP_PATH",
        "VIT.PATCH_DROP",
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
            f"product of {show(list(v.C_STEM_STRIDES))} must equal VIT.PATCH_SIZE={v.PATCH_SIZE}",
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
        f"must be a flat list of class indices (integers), got {show(classes)}",
    )
    _require(
        len(set(classes)) == len(classes) and all(k >= 0 for k in classes),
        "DATA.CLASSES",
        f"must be distinct class indices >= 0, got {show(classes)}",
    )
    _require(
        len(classes) <= c.MODEL.NUM_CLASSES,
        "DATA.CLASSES",
        f"keeps {len(classes)} classes, more than MODEL.NUM_CLASSES={c.MODEL.NUM_CLASSES}",
    )
    # (OPTIM.LAYER_DECAY with FairScale: the engine x feature rule, pycls.engines.support)


def _check_optim(c):
    o = c.OPTIM
    _require(len(o.BETAS) == 2, "OPTIM.BETAS", f"needs two values, got {show(list(o.BETAS))}")
    _require(all(0 <= b < 1 for b in o.BETAS), "OPTIM.BETAS", "each beta must be in [0, 1)")
    _require(o.MIN_LR <= o.BASE_LR, "OPTIM.MIN_LR", f"{o.MIN_LR} exceeds BASE_LR={o.BASE_LR}")
    _require(
        list(o.STEPS) == sorted(o.STEPS),
        "OPTIM.STEPS",
        f"must be increasing, got {show(list(o.STEPS))}",
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
        values = list(get(c, key))
        _require(
            len(values) in (0, 3),
            key,
            f"needs 0 (data set default) or 3 values, got {len(values)}: {show(values)}",
        )
    _require(all(s > 0 for s in c.DATA.STD), "DATA.STD", "every value must be > 0")
    dl = c.DATA_LOADER
    sharded = dl.BACKEND in ("wds", "parquet")
    _require(
        sharded or dl.ORDER in ("auto", "global"),
        "DATA_LOADER.ORDER",
        f"{dl.ORDER!r} reads shard by shard: it needs BACKEND wds or parquet, not {dl.BACKEND}",
    )
    _require(
        sharded or c.DATA.TEST_PATH == "",
        "DATA.TEST_PATH",
        f"names evaluation shards of BACKEND wds or parquet, not {dl.BACKEND}",
    )
    if dl.BACKEND == "shards":  # prepared shards replace the raw data folder
        _require(dl.SHARD_PATH != "", "DATA_LOADER.SHARD_PATH", "BACKEND shards needs the folder")
    elif sharded:
        _require(c.DATA.PATH != "", "DATA.PATH", f"BACKEND {dl.BACKEND} needs the shards' path")
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
    "distillation token": lambda c: c.MODEL.TYPE == "vit" and c.VIT.DIST_TOKEN,
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
    "patch dropout": lambda c: c.VIT.PATCH_DROP > 0,
    "token budget": lambda c: c.TRAIN.TOKEN_BUDGET > 0,
    "drop-path skip": lambda c: c.VIT.DROP_PATH_MODE == "skip" and c.VIT.DROP_PATH > 0,
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


def _check_mesh(c):
    """MESH.*: only under TRAIN.PARALLEL tensor; TP must divide the heads and the MLP width, and
    the mesh the processes when their number is known now (NUM_PROCS; a launcher's processes are
    checked at launch: pycls.distributed.preflight)."""
    m, v = c.MESH, c.VIT
    if c.TRAIN.PARALLEL != "tensor":
        for key, default in (("MESH.TP", 1), ("MESH.PP", 1), ("MESH.DP", 0)):
            _require(
                get(c, key) == default,
                key,
                f"{get(c, key)} describes the device mesh of TRAIN.PARALLEL tensor, not of "
                f"TRAIN.PARALLEL {c.TRAIN.PARALLEL}",
            )
        return
    if c.MODEL.TYPE != "vit":
        return  # the engine x feature rule names the CNN families
    for key, n in (("VIT.NUM_HEADS", v.NUM_HEADS), ("VIT.MLP_DIM", v.MLP_DIM)):
        _require(
            n % m.TP == 0,
            "MESH.TP",
            f"{m.TP} does not divide {key}={n} (each process holds an equal share of the heads "
            "and of the hidden channels); values that divide VIT.NUM_HEADS and VIT.MLP_DIM: "
            f"{tp_divisors(math.gcd(v.NUM_HEADS, v.MLP_DIM))}",
        )
    chunks = m.PP * c.PIPELINE.STAGES_PER_RANK
    _require(
        m.PP == 1 or chunks <= v.DEPTH,
        "MESH.PP",
        f"{m.PP} stages x PIPELINE.STAGES_PER_RANK {c.PIPELINE.STAGES_PER_RANK} = {chunks} "
        f"chunks, more than the {v.DEPTH} blocks of VIT.DEPTH (every chunk needs a block)",
    )
    stages = c.PIPELINE.STAGES
    _require(
        stages in (DEFAULTS.PIPELINE.STAGES, m.PP),
        "PIPELINE.STAGES",
        f"{stages}: under TRAIN.PARALLEL tensor the pipeline's stages are MESH.PP ({m.PP}); set "
        f"MESH.PP {stages} instead",
    )
    _require(
        not c.FSDP.CPU_OFFLOAD,
        "FSDP.CPU_OFFLOAD",
        "is untested with TRAIN.PARALLEL tensor (host-resident shards of tensor-parallel parts); "
        "set it False",
    )
    _require(
        m.PP == 1 or c.FSDP.RESHARD_AFTER_FORWARD == DEFAULTS.FSDP.RESHARD_AFTER_FORWARD,
        "FSDP.RESHARD_AFTER_FORWARD",
        "applies to FSDP2, which MESH.PP > 1 does not run (the replicas of a stage average its "
        "gradients); leave it at its default",
    )
    if c.NUM_PROCS > 1:
        mesh_shape(c.NUM_PROCS, m.DP, m.TP, m.PP)


def _both(ok, key, other, why):
    """A pair of keys that cannot be used together: the message names both."""
    _require(ok, key, f"cannot be used with {other}: {why}")


def _check_token_budget(c):
    t, v = c.TRAIN, c.VIT
    sizes = list(t.TOKEN_SIZES) or [t.IM_SIZE]
    if t.TOKEN_BUDGET == 0:
        for key, unset in (
            ("TRAIN.TOKEN_SIZES", []),
            ("TRAIN.TOKEN_MAX_ASPECT", 1.0),
            ("TRAIN.TOKEN_MIN_SCALE", 1.0),
            ("TRAIN.TOKEN_PACKING", False),
        ):
            _require(get(c, key) == unset, key, "needs TRAIN.TOKEN_BUDGET > 0 (token batches)")
        return
    _require(c.MODEL.TYPE == "vit", "TRAIN.TOKEN_BUDGET", "token batches need MODEL.TYPE vit")
    p = v.PATCH_SIZE
    _require(
        all(isinstance(s, int) and s > 0 and s % p == 0 for s in sizes),
        "TRAIN.TOKEN_SIZES",
        f"every size must be a positive multiple of VIT.PATCH_SIZE={p}, got {sizes}",
    )
    _require(
        t.TOKEN_MAX_ASPECT >= 1, "TRAIN.TOKEN_MAX_ASPECT", f"must be >= 1, got {t.TOKEN_MAX_ASPECT}"
    )
    _require(
        0 < t.TOKEN_MIN_SCALE <= 1,
        "TRAIN.TOKEN_MIN_SCALE",
        f"must be in (0, 1], got {t.TOKEN_MIN_SCALE}",
    )
    shares = c.NUM_PROCS * t.ACCUM_STEPS
    largest = (max(sizes) // p) ** 2
    _require(
        largest * shares <= t.TOKEN_BUDGET,
        "TRAIN.TOKEN_BUDGET",
        f"{t.TOKEN_BUDGET} patch tokens split over NUM_PROCS x TRAIN.ACCUM_STEPS = {shares} "
        f"micro-batches leave less than one image of the largest size {max(sizes)} px "
        f"({largest} patches) each",
    )
    why_ffn = "the local feed-forward convolves a whole square grid"
    _both(v.FFN != "local", "TRAIN.TOKEN_BUDGET", "VIT.FFN local", why_ffn)
    _both(
        v.STEM_TYPE != "conv",
        "TRAIN.TOKEN_BUDGET",
        "VIT.STEM_TYPE conv",
        "the conv stem's batch norm would count the padding of the images' canvas",
    )
    _both(
        v.PATCH_DROP == 0,
        "VIT.PATCH_DROP",
        "TRAIN.TOKEN_BUDGET",
        "the token budget already sets each batch's tokens; lower TRAIN.TOKEN_SIZES instead",
    )
    _both(
        not c.CURRICULUM.ENABLED,
        "CURRICULUM.ENABLED",
        "TRAIN.TOKEN_BUDGET",
        "both set the training sizes; use TRAIN.TOKEN_SIZES",
    )
    _both(
        not (t.COMPILE and t.COMPILE_SCOPE == "model"),
        "TRAIN.COMPILE_SCOPE",
        "TRAIN.TOKEN_BUDGET",
        "a whole-model graph would be compiled again for every batch's grids; use blocks",
    )
    _both(
        c.DATA_LOADER.AUGMENT_DEVICE != "gpu",
        "DATA_LOADER.AUGMENT_DEVICE",
        "TRAIN.TOKEN_BUDGET",
        "each image of a token batch is augmented at its own size on the CPU; use cpu or auto",
    )
    _both(
        c.AMP.FLOAT8 == "none",
        "AMP.FLOAT8",
        "TRAIN.TOKEN_BUDGET",
        _FLOAT8_ROWS.format(rows="a token batch's sequences x positions"),
    )
    _both(
        c.DISTILL.TYPE == "none",
        "DISTILL.TYPE",
        "TRAIN.TOKEN_BUDGET",
        "the teacher takes a batch of equal images, not a token batch of several grids",
    )
    _both(
        not v.DIST_TOKEN,
        "VIT.DIST_TOKEN",
        "TRAIN.TOKEN_BUDGET",
        "token batches carry the class and register tokens, not the distillation token",
    )
    _both(
        c.DATA_LOADER.ORDER in ("auto", "global"),
        "DATA_LOADER.ORDER",
        "TRAIN.TOKEN_BUDGET",
        f"{c.DATA_LOADER.ORDER!r} (auto's choice for parquet and URLs) reads shard by shard, and "
        "the token budget plans its epoch as one permutation of every sample; set "
        "DATA_LOADER.ORDER global (each sample read on its own: slower from parquet or a URL)",
    )


# float8 x what makes a batch's token count arbitrary (untested on a GPU, where it would fail)
_FLOAT8_ROWS = (
    "float8's matmul (torch._scaled_mm) needs each weight gradient's inner dimension, the tokens "
    "of the batch, to be a multiple of 16 (torchao does not pad it by default), and {rows} is "
    "not; set AMP.FLOAT8 none"
)


def _check_patch_drop(c):
    v = c.VIT
    _both(
        not (c.AMP.FLOAT8 != "none" and v.DROP_PATH_MODE == "skip" and v.DROP_PATH > 0),
        "AMP.FLOAT8",
        "VIT.DROP_PATH_MODE skip",
        _FLOAT8_ROWS.format(rows="the kept samples x tokens of a block"),
    )
    if v.PATCH_DROP > 0:
        _require(c.MODEL.TYPE == "vit", "VIT.PATCH_DROP", "patch dropout needs MODEL.TYPE vit")
        _both(
            v.FFN != "local",
            "VIT.PATCH_DROP",
            "VIT.FFN local",
            "the local feed-forward convolves every patch of the grid",
        )
    if v.PATCH_DROP_SCHEDULE == "curriculum":
        _require(
            c.CURRICULUM.ENABLED,
            "VIT.PATCH_DROP_SCHEDULE",
            "curriculum ties the rate to CURRICULUM's sizes: set CURRICULUM.ENABLED",
        )
        _require(v.PATCH_DROP > 0, "VIT.PATCH_DROP_SCHEDULE", "curriculum needs VIT.PATCH_DROP > 0")
    if v.PACKED_ATTENTION == "flex":
        _require(
            has_flex_attention(),
            "VIT.PACKED_ATTENTION",
            "flex needs a torch with FlexAttention; use sdpa",
        )
        _both(
            c.DEVICE != "cpu",
            "VIT.PACKED_ATTENTION",
            "DEVICE cpu",
            "FlexAttention has no backward pass on the CPU; use sdpa",
        )
        _both(
            v.ATTN_DROPOUT == 0,
            "VIT.PACKED_ATTENTION",
            "VIT.ATTN_DROPOUT",
            "FlexAttention has no attention dropout; use sdpa",
        )
        _both(
            not (v.DROP_PATH_MODE == "skip" and v.DROP_PATH > 0),
            "VIT.PACKED_ATTENTION",
            "VIT.DROP_PATH_MODE skip",
            "a block mask cannot be cut to the kept sequences; use sdpa",
        )


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
        _require(value in allowed, key, f"{show(value)} is not one of {list(allowed)}")
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
        _check_list_items,
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
        _check_patch_drop,
        _check_token_budget,
        _check_engine,
        _check_mesh,
    ):
        check(c)
