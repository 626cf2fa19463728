"""What a run writes and how it is seeded and logged (OUT_DIR, RNG_SEED, LOG_PERIOD, TensorBoard,
W&B, determinism), and the keys of the modes that do not train: the learning-rate range test
(LRFIND, --mode lrfind), timing (PREC_TIME, --mode time) and model scaling (MODEL.SCALING_*,
--mode scale).
"""

from pycls.config.sections.key_checks import CfgNode, require

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.MODEL = CfgNode()
_C.LRFIND = CfgNode()
_C.PREC_TIME = CfgNode()

# Model scaling ("Fast and Accurate Model Scaling"), read by --mode scale only: the type names the
# dimensions and their weights ("d1_w8_g8_r1" is fast compound scaling; "dw" = "d1_w1"), the factor
# the multiple of FLOPs wanted (pycls.core.scale_config)
_C.MODEL.SCALING_TYPE = ""
_C.MODEL.SCALING_FACTOR = 1.0

# The LR grows exponentially from START_LR to END_LR over NUM_ITERS iterations
_C.LRFIND.START_LR = 1e-7
_C.LRFIND.END_LR = 10.0
_C.LRFIND.NUM_ITERS = 200

# Stop once the smoothed loss exceeds DIVERGE_FACTOR x its minimum
_C.LRFIND.DIVERGE_FACTOR = 4.0

# Exponential smoothing of the loss curve (0 = none)
_C.LRFIND.SMOOTHING = 0.05

# Untimed warm-up iterations, then timed iterations
_C.PREC_TIME.WARMUP_ITER = 3
_C.PREC_TIME.NUM_ITER = 10

# Time the evaluation forward pass (test_fw_time) compiled too. False: it runs eager, so --mode
# time compiles only the training graphs, as training does (evaluation graphs of a compiled
# model cost their own compile time and memory); needs TRAIN.COMPILE
_C.PREC_TIME.COMPILE_TEST = False

# Output folder for logs, the resolved config, checkpoints and plots
_C.OUT_DIR = "/tmp/pycls"

# Load sharded folders without a manifest.json (an older pycls's, another program's DCP folder):
# nothing in them is verified. A folder pycls sealed is refused without its manifest regardless
_C.ALLOW_UNVERIFIED_CHECKPOINTS = False

# Name of the resolved config written to OUT_DIR
_C.CFG_DEST = "config.yaml"

# Seed of every random generator (python, numpy, torch, data order and augmentation)
_C.RNG_SEED = 1

# Log a train_iter json_stats line (and synchronise the device) every this many iterations
_C.LOG_PERIOD = 10

# Also write the logged scalars (loss, top-1/top-5 error in %, lr, images/s, peak memory in MiB) as
# TensorBoard event files in OUT_DIR/tensorboard (needs the tensorboard package;
# pycls.core.curve_writers)
_C.TENSORBOARD = False

# Also send those scalars to this Weights & Biases project ("" = off; needs the wandb package)
_C.WANDB_PROJECT = ""

# Deterministic algorithms (cudnn.deterministic, no benchmark): slower, bitwise repeatable
_C.DETERMINISTIC = False


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
POSITIVE = ["PREC_TIME.NUM_ITER", "LOG_PERIOD"]
NON_NEGATIVE = ["PREC_TIME.WARMUP_ITER"]
BELOW_ONE = ["LRFIND.SMOOTHING"]

# The largest RNG_SEED: numpy seeds take 32 bits, and each process adds its rank
MAX_SEED = 2**31 - 1


def check(c):
    require(
        0 <= c.RNG_SEED <= MAX_SEED, "RNG_SEED", f"must be in [0, {MAX_SEED}], got {c.RNG_SEED}"
    )
    require(
        c.LRFIND.START_LR < c.LRFIND.END_LR,
        "LRFIND.END_LR",
        f"{c.LRFIND.END_LR} must exceed LRFIND.START_LR={c.LRFIND.START_LR}",
    )
    require(
        c.TRAIN.COMPILE or not c.PREC_TIME.COMPILE_TEST,
        "PREC_TIME.COMPILE_TEST",
        f"{c.PREC_TIME.COMPILE_TEST} says how TRAIN.COMPILE compiles, but TRAIN.COMPILE is False: "
        "set it True, or leave this key at its default",
    )
