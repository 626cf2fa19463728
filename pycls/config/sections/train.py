"""The training loop's keys: TRAIN's batch, image size, periods, checkpoints, initial weights,
fine-tuning, accumulation and EMA; TEST's batch, size and weights; the recipes CURRICULUM (the
image-size curriculum, "Training a ViT from scratch in less than 24 hours with 1 GPU") and MIXUP
(mixup and CutMix on the device, per batch: torchvision.transforms.v2.MixUp / CutMix).
"""

from pycls.config.sections.key_checks import CfgNode, get, require
from pycls.errors import ConfigError
from pycls.models.cnn.zoo_table import ZOO
from pycls.models.layer_ids import parse_freeze

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.TRAIN = CfgNode()
_C.TEST = CfgNode()
_C.CURRICULUM = CfgNode()
_C.MIXUP = CfgNode()

# Global batch size (split over processes)
_C.TRAIN.BATCH_SIZE = 128

# Training image size (square, pixels)
_C.TRAIN.IM_SIZE = 224

# Label smoothing of the cross-entropy target
_C.TRAIN.LABEL_SMOOTHING = 0.0

# Evaluate every this many epochs (and always after the last)
_C.TRAIN.EVAL_PERIOD = 1

# Save a checkpoint every this many epochs (and always after the last)
_C.TRAIN.CHECKPOINT_PERIOD = 1

# Keep only this many of the newest epoch checkpoints, removing older ones after each save (0 keeps
# all). OUT_DIR/checkpoints/model_best.pyth and OUT_DIR/model_final.safetensors are always kept.
# More than 1 leaves an older checkpoint to resume from should the newest be unreadable
_C.TRAIN.KEEP_CHECKPOINTS = 0

# Write checkpoints while training goes on: the state is copied to host memory (the only wait),
# then written, checksummed and renamed into place in the background (DCP's async_save for
# sharded engines). At most one write is in flight (the next save waits for it, and says so);
# a checkpoint is visible only once whole and verified, as a synchronous one; a stop signal, the
# end of the run and an error wait for it. Needs host memory for one more copy of the checkpoint
_C.TRAIN.ASYNC_CHECKPOINT = False

# Hung-run watchdog: when no training step finishes for this many seconds (evaluation,
# checkpoints and a step that compiles not counted), every process that can still run writes its
# Python stack to OUT_DIR/hang/, one line names the processes that did not reach the collective
# the others wait in (or do not respond), and every process exits with status 1, for a restart
# and TRAIN.AUTO_RESUME to take over; 0 turns it off. The first step of an epoch includes the
# loader's first batches
_C.TRAIN.HANG_TIMEOUT = 600.0

# How often (seconds) each process's watchdog publishes its progress and listens for the alarm.
# A stop signal the loop cannot act on (blocked in a collective) is honoured once no step has
# finished for max(3 x this, 3 x the longest step): stacks written, the stop's exit status
_C.TRAIN.HANG_CHECK_PERIOD = 5.0

# Resume from the newest checkpoint in OUT_DIR/checkpoints if there is one
_C.TRAIN.AUTO_RESUME = True

# Initialise from these weights before training ("" for random init): a pycls checkpoint (.pyth),
# a .safetensors file, or a torch file holding a plain state dict (or one under "model" /
# "state_dict") in pycls, timm or torchvision naming. A head for another number of classes is
# dropped (the model's own head init is kept, see VIT.HEAD_INIT_SCALE); a position embedding
# for another image size is resampled. Not used when resuming from OUT_DIR/checkpoints
_C.TRAIN.WEIGHTS = ""

# Naming of TRAIN.WEIGHTS: "auto" (detected from the keys), "pycls", "timm" or "torchvision"
_C.TRAIN.WEIGHTS_FORMAT = "auto"

# Train only part of the model, the rest frozen: "none" (train everything), "head" (the
# classifier only: a linear probe) or "last_K" (the last K blocks, the final norm and the head)
_C.TRAIN.FREEZE = "none"

# Gradient accumulation (>= 1): each optimizer step sums ACCUM_STEPS micro-batches of
# BATCH_SIZE / ACCUM_STEPS images (the same update as one batch of BATCH_SIZE)
_C.TRAIN.ACCUM_STEPS = 1

# Keep an exponential moving average of the weights, evaluated beside the raw model
_C.TRAIN.EMA = False

# EMA decay per optimizer step
_C.TRAIN.EMA_DECAY = 0.9998

# Ramp the decay up as min(EMA_DECAY, (1 + t) / (10 + t)) over the first steps t, so the average
# is not dominated by the random initial weights
_C.TRAIN.EMA_WARMUP = True

# Update the EMA every this many optimizer steps (the decay is adjusted to match)
_C.TRAIN.EMA_PERIOD = 1

# Global batch size for evaluation
_C.TEST.BATCH_SIZE = 256

# Evaluation image size (square, pixels). A config that does not set it evaluates at
# TRAIN.IM_SIZE, as upstream pycls and timm do (0 says the same); config.yaml records the size
_C.TEST.IM_SIZE = 224

# Weights evaluated by --mode test (a pycls checkpoint)
_C.TEST.WEIGHTS = ""

# Train at growing image sizes: START_SIZE, + STEP every EPOCHS_PER_STEP epochs, up to TRAIN.IM_SIZE
_C.CURRICULUM.ENABLED = False

# First training image size (a multiple of VIT.PATCH_SIZE)
_C.CURRICULUM.START_SIZE = 32

# Pixels added at each step (a multiple of VIT.PATCH_SIZE)
_C.CURRICULUM.STEP = 16

# Epochs spent at each size before the next step
_C.CURRICULUM.EPOCHS_PER_STEP = 1

# Grow the batch as the image shrinks so tokens per batch stay about constant (rounded down to a
# multiple of the process count and TRAIN.ACCUM_STEPS)
_C.CURRICULUM.SCALE_BATCH = False

# Evaluate at TEST.IM_SIZE (the final size) rather than at the current training size
_C.CURRICULUM.EVAL_AT_FINAL_SIZE = True

# Mixup alpha (Beta(alpha, alpha) mixing weight); 0 disables mixup
_C.MIXUP.ALPHA = 0.0

# CutMix alpha; 0 disables cutmix
_C.MIXUP.CUTMIX_ALPHA = 0.0

# Probability of mixing a batch at all
_C.MIXUP.PROB = 1.0

# When both are on: probability of CutMix instead of Mixup for a mixed batch
_C.MIXUP.SWITCH_PROB = 0.5

# Stop mixing from this epoch on (0 = mix until the end), as in late-training clean epochs
_C.MIXUP.OFF_EPOCH = 0


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {"TRAIN.WEIGHTS_FORMAT": ("auto", "pycls", "timm", "torchvision")}
POSITIVE = [
    "TRAIN.BATCH_SIZE",
    "TRAIN.ACCUM_STEPS",
    "TRAIN.IM_SIZE",
    "TRAIN.EVAL_PERIOD",
    "TRAIN.CHECKPOINT_PERIOD",
    "TRAIN.HANG_CHECK_PERIOD",
    "TEST.BATCH_SIZE",
    "TEST.IM_SIZE",
]
NON_NEGATIVE = ["TRAIN.KEEP_CHECKPOINTS", "TRAIN.LABEL_SMOOTHING", "TRAIN.HANG_TIMEOUT"]
BELOW_ONE = ["TRAIN.LABEL_SMOOTHING", "TRAIN.EMA_DECAY"]
FRACTIONS = ["MIXUP.PROB", "MIXUP.SWITCH_PROB", "TRAIN.EMA_DECAY"]

# TRAIN.WEIGHTS / TEST.WEIGHTS prefix naming a published zoo model ("zoo:RegNetY-800MF")
ZOO_PREFIX = "zoo:"


def check(c):
    t = c.TRAIN
    require(
        t.BATCH_SIZE % t.ACCUM_STEPS == 0,
        "TRAIN.ACCUM_STEPS",
        f"TRAIN.BATCH_SIZE={t.BATCH_SIZE} is not divisible by TRAIN.ACCUM_STEPS={t.ACCUM_STEPS}",
    )
    try:
        parse_freeze(t.FREEZE, c.VIT.DEPTH)
    except ValueError:
        raise ConfigError(
            f"TRAIN.FREEZE: {t.FREEZE!r} is not 'none', 'head' or 'last_K' with 1 <= K <= "
            f"VIT.DEPTH={c.VIT.DEPTH}"
        ) from None
    for key in ("TRAIN.WEIGHTS", "TEST.WEIGHTS"):
        value = get(c, key)
        if value.startswith(ZOO_PREFIX):
            name = value[len(ZOO_PREFIX) :]
            require(name in ZOO, key, f"{name!r} is not in the zoo; one of {list(ZOO)}")
    require(
        t.HANG_TIMEOUT == 0 or t.HANG_CHECK_PERIOD < t.HANG_TIMEOUT,
        "TRAIN.HANG_CHECK_PERIOD",
        f"{t.HANG_CHECK_PERIOD} s must be shorter than TRAIN.HANG_TIMEOUT={t.HANG_TIMEOUT} s",
    )
    _check_curriculum(c)


def _check_curriculum(c):
    t, cur = c.TRAIN, c.CURRICULUM
    if not cur.ENABLED:
        return
    p = c.VIT.PATCH_SIZE if c.MODEL.TYPE == "vit" else 1
    for key in ("CURRICULUM.START_SIZE", "CURRICULUM.STEP"):
        require(
            get(c, key) % p == 0,
            key,
            f"{get(c, key)} is not a multiple of VIT.PATCH_SIZE={p} (MODEL.TYPE {c.MODEL.TYPE})",
        )
    require(
        cur.START_SIZE <= t.IM_SIZE,
        "CURRICULUM.START_SIZE",
        f"{cur.START_SIZE} exceeds TRAIN.IM_SIZE={t.IM_SIZE}",
    )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    "EMA": ("TRAIN.EMA", lambda c: c.TRAIN.EMA),
    "curriculum": ("CURRICULUM.ENABLED", lambda c: c.CURRICULUM.ENABLED),
    "accumulation": ("TRAIN.ACCUM_STEPS", lambda c: c.TRAIN.ACCUM_STEPS > 1),
    "mixup/cutmix": ("MIXUP.ALPHA", lambda c: c.MIXUP.ALPHA > 0 or c.MIXUP.CUTMIX_ALPHA > 0),
}
