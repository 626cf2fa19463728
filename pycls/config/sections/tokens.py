"""Fewer tokens through the ViT (docs/fewer_tokens.md): patch dropout, compute-skipping drop path,
token budgets of images of several grids (padded or packed), and how attention stays inside each
image of a packed sequence.
"""

from pycls.config.sections.data import epoch_order
from pycls.config.sections.key_checks import CfgNode, both, get, require
from pycls.config.sections.model_vit import VIT_RECORD

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means. VIT.PATCH_DROP, VIT.DROP_PATH_MODE
# and VIT.PACKED_ATTENTION are generated from their fields of the ViT's argument record (VitArgs),
# which name this section as their owner
# ------------------------------------------------------------------------------------------------ #
_KEYS = VIT_RECORD.section("tokens")
_C = _KEYS.tree
_C.TRAIN = CfgNode()
# The generated keys' reference texts (a hand-written key has its comment above it)
REFERENCE = _KEYS.reference

# How the patch-dropout rate changes over training: "constant" (PATCH_DROP every epoch) or
# "curriculum" (with CURRICULUM.ENABLED: the rate at each epoch's image size that keeps the tokens
# of a batch where PATCH_DROP puts them at the final size, so small early images drop fewer or none)
_C.VIT.PATCH_DROP_SCHEDULE = "constant"

# Train on every token from this epoch on (0-based; 0 = never): FLIP's unmasked tuning at the end.
# Below OPTIM.MAX_EPOCH (a later epoch never comes)
_C.VIT.PATCH_DROP_OFF_EPOCH = 0

# Token budget (ViT only; 0 = off): patch tokens per optimizer step, all processes together, with
# images of several sizes and aspect ratios in one batch (NaFlex-style). Each step draws a size
# from TOKEN_SIZES (the same in every process); each image gets its own patch grid of at most that
# size's patches (TOKEN_MAX_ASPECT, TOKEN_MIN_SCALE); a micro-batch holds TOKEN_BUDGET /
# (processes x ACCUM_STEPS x the size's patches) sequences of that many patches, one image each
# (padded, with a key-padding mask) or several (TOKEN_PACKING). The learning rate's batch
# (OPTIM.LR_SCALE_BATCH) is TOKEN_BUDGET / (TRAIN.IM_SIZE / VIT.PATCH_SIZE)^2 images, and
# TRAIN.BATCH_SIZE is not used for training. Evaluation is as without it (TEST.IM_SIZE, square).
# A micro-batch's patches, as float pixels, must fit this machine's memory (checked where the run
# runs: pycls.config.machine)
_C.TRAIN.TOKEN_BUDGET = 0

# The sizes (square sides in pixels, multiples of VIT.PATCH_SIZE) a step's images are capped at,
# one drawn per step; [] = [TRAIN.IM_SIZE]
_C.TRAIN.TOKEN_SIZES = []

# Each image's aspect ratio (height / width of its patch grid) is drawn log-uniformly in
# [1 / TOKEN_MAX_ASPECT, TOKEN_MAX_ASPECT] (>= 1; 1: square)
_C.TRAIN.TOKEN_MAX_ASPECT = 1.0

# Each image's patches are drawn uniformly in [TOKEN_MIN_SCALE, 1] x the step's cap (in (0, 1];
# 0.25 makes sides vary 2x; 1: every image at the cap)
_C.TRAIN.TOKEN_MIN_SCALE = 1.0

# Pack several images into each sequence (NaViT) instead of padding each to the cap: attention
# stays inside each image (VIT.PACKED_ATTENTION), pooling is per image
_C.TRAIN.TOKEN_PACKING = False


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {**_KEYS.choices, "VIT.PATCH_DROP_SCHEDULE": ("constant", "curriculum")}
POSITIVE = _KEYS.positive
NON_NEGATIVE = [*_KEYS.non_negative, "VIT.PATCH_DROP_OFF_EPOCH", "TRAIN.TOKEN_BUDGET"]
BELOW_ONE = _KEYS.below_one
FRACTIONS = _KEYS.fractions

# float8 x what makes a batch's token count arbitrary (untested on a GPU, where it would fail)
FLOAT8_ROWS = (
    "float8's matmul (torch._scaled_mm) needs each weight gradient's inner dimension, the tokens "
    "of the batch, to be a multiple of 16 (torchao does not pad it by default), and {rows} is "
    "not; set AMP.FLOAT8 none"
)


def check(c):
    _check_patch_drop(c)
    _check_packed_attention(c)
    _check_token_budget(c)


def _check_patch_drop(c):
    v = c.VIT
    require(
        v.PATCH_DROP_OFF_EPOCH < c.OPTIM.MAX_EPOCH,
        "VIT.PATCH_DROP_OFF_EPOCH",
        f"epoch {v.PATCH_DROP_OFF_EPOCH} (0-based) is never reached in a run of OPTIM.MAX_EPOCH "
        f"{c.OPTIM.MAX_EPOCH} epochs: patch dropout would never stop; 0 says that",
    )
    both(
        not (c.AMP.FLOAT8 != "none" and v.DROP_PATH_MODE == "skip" and v.DROP_PATH > 0),
        "AMP.FLOAT8",
        "VIT.DROP_PATH_MODE skip",
        FLOAT8_ROWS.format(rows="the kept samples x tokens of a block"),
    )
    if v.PATCH_DROP > 0:
        require(c.MODEL.TYPE == "vit", "VIT.PATCH_DROP", "patch dropout needs MODEL.TYPE vit")
        both(
            v.FFN != "local",
            "VIT.PATCH_DROP",
            "VIT.FFN local",
            "the local feed-forward convolves every patch of the grid",
        )
    if v.PATCH_DROP_SCHEDULE == "curriculum":
        require(
            c.CURRICULUM.ENABLED,
            "VIT.PATCH_DROP_SCHEDULE",
            "curriculum ties the rate to CURRICULUM's sizes: set CURRICULUM.ENABLED",
        )
        require(v.PATCH_DROP > 0, "VIT.PATCH_DROP_SCHEDULE", "curriculum needs VIT.PATCH_DROP > 0")


def _check_packed_attention(c):
    """FlexAttention's limits; whether this torch has it is asked on the machine that runs
    (pycls.config.machine)."""
    v = c.VIT
    if v.PACKED_ATTENTION != "flex":
        return
    require(
        c.DEVICE != "cpu",
        "VIT.PACKED_ATTENTION",
        "flex cannot be used with DEVICE cpu: FlexAttention has no backward pass on the CPU; use "
        "sdpa",
    )
    both(
        v.ATTN_DROPOUT == 0,
        "VIT.PACKED_ATTENTION",
        "VIT.ATTN_DROPOUT",
        "FlexAttention has no attention dropout; use sdpa",
    )
    both(
        not (v.DROP_PATH_MODE == "skip" and v.DROP_PATH > 0),
        "VIT.PACKED_ATTENTION",
        "VIT.DROP_PATH_MODE skip",
        "a block mask cannot be cut to the kept sequences; use sdpa",
    )


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
            require(get(c, key) == unset, key, "needs TRAIN.TOKEN_BUDGET > 0 (token batches)")
        return
    require(c.MODEL.TYPE == "vit", "TRAIN.TOKEN_BUDGET", "token batches need MODEL.TYPE vit")
    p = v.PATCH_SIZE
    require(
        all(isinstance(s, int) and s > 0 and s % p == 0 for s in sizes),
        "TRAIN.TOKEN_SIZES",
        f"every size must be a positive multiple of VIT.PATCH_SIZE={p}, got {sizes}"
        + ("" if t.TOKEN_SIZES else " (TRAIN.IM_SIZE)"),
    )
    require(
        t.TOKEN_MAX_ASPECT >= 1, "TRAIN.TOKEN_MAX_ASPECT", f"must be >= 1, got {t.TOKEN_MAX_ASPECT}"
    )
    require(
        0 < t.TOKEN_MIN_SCALE <= 1,
        "TRAIN.TOKEN_MIN_SCALE",
        f"must be in (0, 1], got {t.TOKEN_MIN_SCALE}",
    )
    shares = c.NUM_PROCS * t.ACCUM_STEPS
    largest = (max(sizes) // p) ** 2
    require(
        largest * shares <= t.TOKEN_BUDGET,
        "TRAIN.TOKEN_BUDGET",
        f"{t.TOKEN_BUDGET} patch tokens split over NUM_PROCS x TRAIN.ACCUM_STEPS = {shares} "
        f"micro-batches leave less than one image of the largest size {max(sizes)} px "
        f"({largest} patches) each",
    )
    _check_token_budget_pairs(c)


def _check_token_budget_pairs(c):
    """What a token budget cannot be combined with, each pair named."""
    t, v = c.TRAIN, c.VIT
    why_ffn = "the local feed-forward convolves a whole square grid"
    both(v.FFN != "local", "TRAIN.TOKEN_BUDGET", "VIT.FFN local", why_ffn)
    both(
        v.STEM_TYPE != "conv",
        "TRAIN.TOKEN_BUDGET",
        "VIT.STEM_TYPE conv",
        "the conv stem's batch norm would count the padding of the images' canvas",
    )
    both(
        v.PATCH_DROP == 0,
        "VIT.PATCH_DROP",
        "TRAIN.TOKEN_BUDGET",
        "the token budget already sets each batch's tokens; lower TRAIN.TOKEN_SIZES instead",
    )
    both(
        not c.CURRICULUM.ENABLED,
        "CURRICULUM.ENABLED",
        "TRAIN.TOKEN_BUDGET",
        "both set the training sizes; use TRAIN.TOKEN_SIZES",
    )
    both(
        not (t.COMPILE and t.COMPILE_SCOPE == "model"),
        "TRAIN.COMPILE_SCOPE",
        "TRAIN.TOKEN_BUDGET",
        "a whole-model graph would be compiled again for every batch's grids (TRAIN.COMPILE); use "
        "blocks",
    )
    both(
        c.DATA_LOADER.AUGMENT_DEVICE != "gpu",
        "DATA_LOADER.AUGMENT_DEVICE",
        "TRAIN.TOKEN_BUDGET",
        "each image of a token batch is augmented at its own size on the CPU; use cpu or auto",
    )
    both(
        c.AMP.FLOAT8 == "none",
        "AMP.FLOAT8",
        "TRAIN.TOKEN_BUDGET",
        FLOAT8_ROWS.format(rows="a token batch's sequences x positions"),
    )
    both(
        c.DISTILL.TYPE == "none",
        "DISTILL.TYPE",
        "TRAIN.TOKEN_BUDGET",
        "the teacher takes a batch of equal images, not a token batch of several grids",
    )
    both(
        not v.DIST_TOKEN,
        "VIT.DIST_TOKEN",
        "TRAIN.TOKEN_BUDGET",
        "token batches carry the class and register tokens, not the distillation token",
    )
    order = epoch_order(c)
    both(
        order == "global",
        "DATA_LOADER.ORDER",
        "TRAIN.TOKEN_BUDGET",
        f"{order!r} (auto's choice for parquet and URLs) reads shard by shard, and "
        "the token budget plans its epoch as one permutation of every sample; set "
        "DATA_LOADER.ORDER global (each sample read on its own: slower from parquet or a URL)",
    )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    **_KEYS.features,  # patch dropout, drop-path skip: declared on their fields
    "token budget": ("TRAIN.TOKEN_BUDGET", lambda c: c.TRAIN.TOKEN_BUDGET > 0),
}
