"""VIT: the Vision Transformer's shape and options (the keys that make fewer tokens run through it
are the ``tokens`` section's). What the keys become is ``VIT_ARGS``, the model's own argument
record (``pycls.models.vit.args.VitArgs``), which also checks them (``check_arguments``).
"""

import math

from pycls.config.sections.key_checks import CfgNode, both, get, keys_read, require, show
from pycls.errors import ConfigError
from pycls.models.vit.args import (
    ATTENTION_BACKENDS,
    CLASSIFIERS,
    CUDA_ATTENTION,
    FFNS,
    HALF_ATTENTION,
    LAYOUTS,
    POS_EMBEDS,
    STEMS,
    VitArgs,
    VitArgsError,
)

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
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

# Classifier: "token" (class token) or "pooled" (average of the patch tokens, no class token).
# The default is the original ViT's, the same as VisionTransformer's and the zoo functions'
# (vit_b16(...)); the ViT configs in configs/ that train from scratch choose "pooled" explicitly
_C.VIT.CLASSIFIER = "token"

# Token layout through the encoder: "batch_first" (N, L, D) or "batch_second" (L, N, D). The
# default is VisionTransformer's; every ViT config in configs/ chooses one explicitly
# ("batch_second" for the small images of the quickstart and CIFAR)
_C.VIT.LAYOUT = "batch_first"

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

# The kernel of the blocks' attention (scaled_dot_product_attention): "default" (torch picks per
# call), or one pinned: "cudnn", "flash" (FlashAttention-2), "efficient" (memory-efficient) or
# "math". cudnn, flash and efficient need CUDA (flash and cudnn half inputs: AMP.LEVEL O1-O3);
# a kernel that cannot take the shapes fails at the first step with torch's "No available kernel".
# Not with token batches (TRAIN.TOKEN_BUDGET), whose attention goes through a mask
# (docs/recipes.md)
_C.VIT.ATTENTION_BACKEND = "default"

# LayerNorm epsilon
_C.VIT.NORM_EPS = 1e-6

# Activation checkpointing: recompute the first k blocks in the backward pass (saves memory)
_C.VIT.CHECKPOINT_BLOCKS = 0

# Keep a class token with the pooled classifier too (MAE/BEiT fine-tuning layout: the token takes
# part in attention, the head averages the patch tokens); the token classifier always has one
_C.VIT.CLASS_TOKEN = False

# Learned register tokens after the class token ("Vision Transformers need registers"); they are
# left out of the pooled average
_C.VIT.NUM_REGISTERS = 0

# Bias in the attention's qkv projection (False in some pretrained models)
_C.VIT.QKV_BIAS = True

# A LayerNorm on the embedded tokens before the first block, and no bias in the patchify
# projection (CLIP-style, timm's pre_norm)
_C.VIT.PRE_NORM = False

# Normalise after pooling instead of before it (timm's fc_norm, as in MAE/BEiT fine-tuning)
_C.VIT.FC_NORM = False

# A pre-logits layer before the head: Linear(WIDTH, this) + tanh, as the original ViT and
# big_vision's rep_size (its "Better plain ViT baselines" config: rep_size True, the model's
# width); 0 = none
_C.VIT.REPRESENTATION_SIZE = 0

# Classifier head initialisation: 0 = zeros; s > 0 = truncated normal with std 0.02 * s (BEiT and
# MAE fine-tune with 0.001)
_C.VIT.HEAD_INIT_SCALE = 0.0

# DeiT's distillation token: a second token after the class token, read by a second head
# (head_dist) that DISTILL trains on the teacher's predictions; evaluation averages the two heads.
# The layout of timm's deit_*_distilled_patch16_224 (VisionTransformerDistilled)
_C.VIT.DIST_TOKEN = False


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {
    "VIT.STEM_TYPE": STEMS,
    "VIT.CLASSIFIER": CLASSIFIERS,
    "VIT.LAYOUT": LAYOUTS,
    "VIT.FFN": FFNS,
    "VIT.POS_EMBED": POS_EMBEDS,
    "VIT.ATTENTION_BACKEND": ATTENTION_BACKENDS,
}
POSITIVE = ["VIT.PATCH_SIZE", "VIT.DEPTH", "VIT.WIDTH", "VIT.NUM_HEADS", "VIT.MLP_DIM"]
NON_NEGATIVE = [
    "VIT.DROPOUT",
    "VIT.ATTN_DROPOUT",
    "VIT.DROP_PATH",
    "VIT.NORM_EPS",
    "VIT.CHECKPOINT_BLOCKS",
    "VIT.NUM_REGISTERS",
    "VIT.HEAD_INIT_SCALE",
    "VIT.REPRESENTATION_SIZE",
]
BELOW_ONE = ["VIT.DROPOUT", "VIT.ATTN_DROPOUT", "VIT.DROP_PATH"]


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
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    "distillation token": ("VIT.DIST_TOKEN", lambda c: c.MODEL.TYPE == "vit" and c.VIT.DIST_TOKEN),
    "attention backend": ("VIT.ATTENTION_BACKEND", lambda c: c.VIT.ATTENTION_BACKEND != "default"),
}


# ------------------------------------------------------------------------------------------------ #
# What the keys become: VisionTransformer's arguments (pycls.models.vit.args.VitArgs), one row per
# argument. The same table builds the model and tells which keys shape it (the resume check)
# ------------------------------------------------------------------------------------------------ #
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
    "representation_size": lambda c: c.VIT.REPRESENTATION_SIZE or None,
    "patch_drop": lambda c: c.VIT.PATCH_DROP,
    "drop_path_mode": lambda c: c.VIT.DROP_PATH_MODE,
    # "auto" is decided for this machine before a run (pycls.config.machine); a config read
    # for elsewhere builds with the boolean mask, which every device runs
    "packed_attention": lambda c: (
        "sdpa" if c.VIT.PACKED_ATTENTION == "auto" else c.VIT.PACKED_ATTENTION
    ),
    "dist_token": lambda c: c.VIT.DIST_TOKEN,
    "attention_backend": lambda c: c.VIT.ATTENTION_BACKEND,
    "residual_dtype": lambda c: c.AMP.RESIDUAL_DTYPE,
}


def vit_arguments(c, image_size=None):
    """The VisionTransformer arguments ``c`` describes (at ``image_size`` if given)."""
    args = {arg: read(c) for arg, read in VIT_ARGS.items()}
    return {**args, "image_size": image_size or args["image_size"]}
