"""VIT: the Vision Transformer's shape and options (the keys that make fewer tokens run through it
are the ``tokens`` section's). Each key is generated from its field of the model's own argument
record (``pycls.models.vit.args.VitArgs``, one declaration per option: ``pycls.options``): its
default, its reference text (docs/configs.md), its value tables, and what it becomes: a row of
``VIT_ARGS``. The record also checks the arguments the keys give (``check_arguments``).
"""

import math

from pycls.config.records import RecordKeys
from pycls.config.sections.key_checks import both, get, keys_read, require, show
from pycls.errors import ConfigError
from pycls.models.vit.args import (
    CUDA_ATTENTION,
    HALF_ATTENTION,
    TRAINING_ONLY_ARGS,
    VitArgs,
    VitArgsError,
)

# ------------------------------------------------------------------------------------------------ #
# The keys, generated from VitArgs's fields: each with its default, its meaning and its values
# ------------------------------------------------------------------------------------------------ #
VIT_RECORD = RecordKeys(VitArgs, "VIT", home="model_vit", applies=lambda c: c.MODEL.TYPE == "vit")
_KEYS = VIT_RECORD.section("model_vit")
_C = _KEYS.tree
# The generated keys' reference texts (a hand-written key has its comment above it)
REFERENCE = _KEYS.reference


# ------------------------------------------------------------------------------------------------ #
# Checks: the value tables (from the fields' choices and bounds) and the combinations
# ------------------------------------------------------------------------------------------------ #
CHOICES = _KEYS.choices
POSITIVE = _KEYS.positive
NON_NEGATIVE = _KEYS.non_negative
BELOW_ONE = _KEYS.below_one
FRACTIONS = _KEYS.fractions


def check(c):
    """The VIT keys in words of keys: image sizes of whole patches, heads that divide the width,
    the conv stem's lists, an attention kernel the device and the AMP level can run."""
    check_attention_backend(c)
    if c.MODEL.TYPE != "vit":
        return  # the CNN families: model_cnn
    v = c.VIT
    for key in ("TRAIN.IM_SIZE", "TEST.IM_SIZE"):
        size = get(c, key)
        require(
            size % v.PATCH_SIZE == 0,
            key,
            f"{size} is not divisible by VIT.PATCH_SIZE={v.PATCH_SIZE}; use a multiple of it",
        )
    require(
        v.WIDTH % v.NUM_HEADS == 0,
        "VIT.WIDTH",
        f"{v.WIDTH} is not divisible by VIT.NUM_HEADS={v.NUM_HEADS}",
    )
    require(
        v.CHECKPOINT_BLOCKS <= v.DEPTH,
        "VIT.CHECKPOINT_BLOCKS",
        f"{v.CHECKPOINT_BLOCKS} exceeds VIT.DEPTH={v.DEPTH}",
    )
    if v.STEM_TYPE == "conv":
        n = len(v.C_STEM_CHANNELS)
        require(
            n > 0 and len(v.C_STEM_KERNELS) == n and len(v.C_STEM_STRIDES) == n,
            "VIT.C_STEM_CHANNELS",
            "VIT.C_STEM_CHANNELS, C_STEM_KERNELS and C_STEM_STRIDES need the same non-zero length",
        )
        require(
            math.prod(v.C_STEM_STRIDES) == v.PATCH_SIZE,
            "VIT.C_STEM_STRIDES",
            f"product of {show(list(v.C_STEM_STRIDES))} must equal VIT.PATCH_SIZE={v.PATCH_SIZE}",
        )


def check_attention_backend(c):
    """VIT.ATTENTION_BACKEND: a ViT's, on a device and at an AMP level its kernel runs; not with
    token batches. DEVICE auto is checked once the machine step has resolved it."""
    backend, key = c.VIT.ATTENTION_BACKEND, "VIT.ATTENTION_BACKEND"
    if backend == "default":
        return
    require(c.MODEL.TYPE == "vit", key, f"pins the ViT's attention kernel; MODEL.TYPE "
            f"{c.MODEL.TYPE} has no attention")  # fmt: skip
    both(
        not (backend in CUDA_ATTENTION and c.DEVICE == "cpu"),
        key,
        "DEVICE cpu",
        f"the {backend} kernel needs CUDA; on the CPU use math or default",
    )
    both(
        not (backend in HALF_ATTENTION and c.AMP.LEVEL == "O0"),
        key,
        "AMP.LEVEL O0",
        f"the {backend} kernel takes float16 or bfloat16 inputs only; use AMP.LEVEL O1-O3, or "
        "efficient or math",
    )
    both(
        c.TRAIN.TOKEN_BUDGET == 0,
        key,
        "TRAIN.TOKEN_BUDGET",
        "a token batch's attention goes through a mask (VIT.PACKED_ATTENTION), which the key "
        "does not pin; use default",
    )


def check_arguments(c):
    """The model's own check (``VitArgs.check``) of the arguments the keys give, after every
    section's checks: what those leave out is refused here, naming the key of the argument."""
    if c.MODEL.TYPE != "vit":
        return
    try:
        VitArgs(**vit_arguments(c)).check()
    except VitArgsError as e:
        keys = sorted(keys_read(VIT_ARGS[e.arg], c)) if e.arg in VIT_ARGS else ["VIT"]
        raise ConfigError(f"{keys[0]}: {e}") from None


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support), from the
# fields that declare one
# ------------------------------------------------------------------------------------------------ #
FEATURES = _KEYS.features


# ------------------------------------------------------------------------------------------------ #
# What the keys become: VisionTransformer's arguments (pycls.models.vit.args.VitArgs), one row per
# argument, generated from the fields. The same table builds the model and tells which keys shape
# it (the resume check)
# ------------------------------------------------------------------------------------------------ #
VIT_ARGS = VIT_RECORD.arguments


def vit_keys(args, cfg=None):
    """[(VIT key, value)] that give the config ``cfg`` (default: the defaults) the network of
    ``args`` (a ``VitArgs``, e.g. a ``from_timm`` model's ``.args``): each shaping argument with
    a key of its own, where ``cfg``'s value differs (the size, the class count and the training
    options are the run's to choose: TRAIN.IM_SIZE, MODEL.NUM_CLASSES, ...). Keys that shape
    nothing there are left out: the conv stem's lists with a patchify stem, VIT.CLASS_TOKEN under
    the token classifier (which always has one)."""
    idle = {"class_token"} if args.classifier == "token" else set()
    if args.stem != "conv":
        idle |= {"conv_stem_channels", "conv_stem_kernels", "conv_stem_strides"}
    out = []
    for name, k in VIT_RECORD.keys.items():
        if name in TRAINING_ONLY_ARGS or k.owner != "model_vit" or name in idle:
            continue
        value = getattr(args, name)
        value = list(value) if isinstance(value, tuple) else value
        if value is None:  # unset: a key cannot hold None, its default reads as unset
            value = k.default
        current = k.default if cfg is None else get(cfg, k.key)
        current = list(current) if isinstance(current, tuple) else current
        if value != current:
            out.append((k.key, value))
    return out


def vit_arguments(c, image_size=None):
    """The VisionTransformer arguments ``c`` describes (at ``image_size`` if given)."""
    args = {arg: read(c) for arg, read in VIT_ARGS.items()}
    return {**args, "image_size": image_size or args["image_size"]}
