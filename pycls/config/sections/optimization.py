"""OPTIM and MUON: the optimizer, its learning-rate schedule, and Muon's rates and decays
(docs/muon.md). What the keys become: the optimizer's settings (``OPTIMIZER_SETTINGS``,
``pycls.optim.OptimizerSettings``) and the schedule's arguments (``LR_SCHEDULE_ARGS``,
``pycls.core.schedules.LRSchedule``).

Muon (OPTIM.OPTIMIZER muon): the matrices inside the ViT's blocks (attention and feed-forward
projections) take Muon's orthogonalised momentum; everything else (patch embedding, head, norms,
biases, position embedding, tokens) takes AdamW at OPTIM.BASE_LR with OPTIM.BETAS, EPS,
WEIGHT_DECAY and WEIGHT_DECAY_NO_DECAY_GROUP. Both follow the one schedule.

Other libraries' optimizers (OPTIM.OPTIMIZER schedulefree_adamw, timm:NAME) train the same
parameter groups on the same schedule; the names the key takes are plain data in
``pycls.optim.library_names``, read here without importing torch or timm (docs/recipes.md).
"""

from pycls.config.sections.key_checks import CfgNode, require, show
from pycls.optim.library_names import (
    OWN,
    SCHEDULE_FREE,
    TIMM_NOT_UNDER_FSDP,
    TIMM_OPTIMIZERS,
    closest_names,
    is_library_optimizer,
    timm_name,
)
from pycls.optim.newton_schulz import max_ns_steps

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.OPTIM = CfgNode()
_C.MUON = CfgNode()

# Optimizer: pycls's fused "sgd", "adamw", "lamb" or "muon" (a ViT's hidden 2-D weights on Muon,
# everything else on AdamW; see MUON); "schedulefree_adamw" (Schedule-Free AdamW, the
# schedulefree package: LR_POLICY constant, its evaluation and checkpoints use its averaged
# weights); or "timm:NAME", an optimizer of timm's registry (timm:lion, timm:laprop, timm:mars,
# ...: pycls.optim.library_names lists them), given OPTIM.BETAS, EPS and MOMENTUM where it takes
# them. Other libraries' optimizers need AMP.LEVEL O0 or O1 and CONTIGUOUS_PARAMS False
_C.OPTIM.OPTIMIZER = "adamw"

# Learning rate at the end of warmup (for the schedule's reference batch, see OPTIM.LR_SCALE_BATCH)
_C.OPTIM.BASE_LR = 1e-3

# Learning rate the schedule decays to (cosine and linear schedules)
_C.OPTIM.MIN_LR = 1e-5

# Schedule after warmup: "cos", "lin", "steps", "constant", "onecycle" or "cyclic"; updated every
# iteration
_C.OPTIM.LR_POLICY = "cos"

# "steps" schedule: epochs at which the rate is multiplied by LR_MULT
_C.OPTIM.STEPS = []
_C.OPTIM.LR_MULT = 0.1

# Number of training epochs
_C.OPTIM.MAX_EPOCH = 100

# "onecycle": fraction of training spent rising from BASE_LR / ONECYCLE_DIV_FACTOR to BASE_LR, then
# cosine annealing to MIN_LR
_C.OPTIM.ONECYCLE_PCT_START = 0.3
_C.OPTIM.ONECYCLE_DIV_FACTOR = 25.0

# "cyclic": triangular cycles between MIN_LR and BASE_LR, each this many epochs long
_C.OPTIM.CYCLE_EPOCHS = 10.0

# Warmup: the rate rises linearly from WARMUP_FACTOR * BASE_LR to the schedule over WARMUP_EPOCHS
# (fractional epochs allowed)
_C.OPTIM.WARMUP_EPOCHS = 0.0
_C.OPTIM.WARMUP_FACTOR = 0.01

# Warmup counted in optimizer steps instead (0 = WARMUP_EPOCHS'), as big_vision and optax count
# it: the epochs it spans follow from the steps per epoch (the training set over the batch)
_C.OPTIM.WARMUP_STEPS = 0

# Where the decay of cos, lin and onecycle starts: False = at epoch 0, spanning the whole run
# (the warmup ramp multiplies its start); True = where the warmup ends, spanning the epochs after
# it (big_vision's schedule, timm's warmup_prefix): the rate peaks at BASE_LR
_C.OPTIM.WARMUP_PREFIX = False

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

# What the weight decay is multiplied by at each step: "lr" = the group's scheduled rate (torch's
# AdamW: the weights shrink by lr x WEIGHT_DECAY); "schedule" = the schedule's factor only, the
# rate over BASE_LR (big_vision and optax: WEIGHT_DECAY 1e-4 at BASE_LR 1e-3 is torch's 0.1, and
# OPTIM.LAYER_DECAY scales the rates, not the decay). Needs LR_SCALE_BATCH 0
_C.OPTIM.WEIGHT_DECAY_SCALE = "lr"

# Keep parameters and gradients as views into one flat buffer per group and dtype, so each fused
# update is one kernel call over the buffer instead of one per tensor. Equal speed on one CPU
# thread; on two threads of a busy CPU several times faster, because a per-tensor update waits at
# one thread barrier per tensor (BENCHMARKS.md)
_C.OPTIM.CONTIGUOUS_PARAMS = False

# AdamW's step as ONE compiled pass over those flat buffers (pycls.optim.one_pass): the update,
# O2's fp32 master weights rounded into the model's half weights, the EMA (TRAIN.EMA) when it
# falls due and the gradients' zeroing, each element read and written once, compiled by inductor
# on every device (a CPU too: the first step compiles for seconds). Needs OPTIM.OPTIMIZER adamw and
# CONTIGUOUS_PARAMS True, under TRAIN.PARALLEL none or ddp; layer decay, clipping and float16
# loss scaling work as without it (docs/recipes.md)
_C.OPTIM.ONE_PASS = False

# Clip the global gradient norm to this value (0 = no clipping)
_C.OPTIM.CLIP_GRAD = 0.0

# Layer-wise learning-rate decay (BEiT/MAE fine-tuning), in (0, 1]: the head trains at the
# scheduled rate, block i (0-based) at LAYER_DECAY ** (VIT.DEPTH - i) times it, the embedding at
# LAYER_DECAY ** (VIT.DEPTH + 1); 1 = the same rate everywhere
_C.OPTIM.LAYER_DECAY = 1.0

# The Muon matrices' learning rate as a multiple of the scheduled rate (1 with ADJUST_LR
# match_rms_adamw, Moonlight's recipe: AdamW's rate carries over; about 0.02 / OPTIM.BASE_LR with
# "original", Keller Jordan's)
_C.MUON.LR_MULT = 1.0

# Decoupled weight decay of the Muon matrices (Moonlight: AdamW's)
_C.MUON.WEIGHT_DECAY = 0.05

# Momentum of the gradient before it is orthogonalised, and Nesterov's form of it
_C.MUON.MOMENTUM = 0.95
_C.MUON.NESTEROV = True

# Newton-Schulz iterations of the orthogonalisation (torch.optim.Muon's default). At most 71: after
# that many every singular value the bfloat16 iteration holds has reached its band
_C.MUON.NS_STEPS = 5

# Scale of each matrix's update by its shape (out, in): "match_rms_adamw" 0.2 * sqrt(max(out, in))
# (the update's RMS is AdamW's) or "original" sqrt(max(1, out / in))
_C.MUON.ADJUST_LR = "match_rms_adamw"


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {
    "OPTIM.LR_POLICY": ("cos", "lin", "steps", "constant", "onecycle", "cyclic"),
    "MUON.ADJUST_LR": ("match_rms_adamw", "original"),
    "OPTIM.WEIGHT_DECAY_SCALE": ("lr", "schedule"),
}
POSITIVE = ["OPTIM.MAX_EPOCH", "OPTIM.LR_MULT", "MUON.LR_MULT", "MUON.NS_STEPS"]
NON_NEGATIVE = [
    "OPTIM.BASE_LR",
    "OPTIM.MIN_LR",
    "OPTIM.WARMUP_EPOCHS",
    "OPTIM.WARMUP_FACTOR",
    "OPTIM.WARMUP_STEPS",
    "OPTIM.LR_SCALE_BATCH",
    "OPTIM.MOMENTUM",
    "OPTIM.DAMPENING",
    "OPTIM.EPS",
    "OPTIM.WEIGHT_DECAY",
    "OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP",
    "OPTIM.CLIP_GRAD",
    "MUON.WEIGHT_DECAY",
    "MUON.MOMENTUM",
]
BELOW_ONE = ["OPTIM.ONECYCLE_PCT_START", "MUON.MOMENTUM"]
FRACTIONS = ["OPTIM.ONECYCLE_PCT_START"]


def check(c):
    o = c.OPTIM
    _check_optimizer_name(o.OPTIMIZER)
    require(len(o.BETAS) == 2, "OPTIM.BETAS", f"needs two values, got {show(list(o.BETAS))}")
    require(all(0 <= b < 1 for b in o.BETAS), "OPTIM.BETAS", "each beta must be in [0, 1)")
    require(o.MIN_LR <= o.BASE_LR, "OPTIM.MIN_LR", f"{o.MIN_LR} exceeds BASE_LR={o.BASE_LR}")
    require(
        list(o.STEPS) == sorted(o.STEPS),
        "OPTIM.STEPS",
        f"must be increasing, got {show(list(o.STEPS))}",
    )
    if o.LR_POLICY == "steps":
        require(len(o.STEPS) > 0, "OPTIM.STEPS", "the 'steps' LR_POLICY needs at least one step")
    require(
        not (o.NESTEROV and o.OPTIMIZER == "sgd" and (o.MOMENTUM <= 0 or o.DAMPENING != 0)),
        "OPTIM.NESTEROV",
        "Nesterov SGD needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING = 0",
    )
    if o.ONE_PASS:  # what it needs that is not so, and only that
        wanting = [f"OPTIM.OPTIMIZER adamw (not {o.OPTIMIZER})"] if o.OPTIMIZER != "adamw" else []
        wanting += [] if o.CONTIGUOUS_PARAMS else ["OPTIM.CONTIGUOUS_PARAMS True (now False)"]
        require(
            not wanting,
            "OPTIM.ONE_PASS",
            f"is AdamW's step as one pass over the flat buffers: it needs {' and '.join(wanting)}",
        )
    require(
        not (o.OPTIMIZER == "muon" and c.MODEL.TYPE != "vit"),
        "OPTIM.OPTIMIZER",
        f"muon orthogonalises the 2-D weights of a ViT's blocks; every hidden weight of "
        f"MODEL.TYPE {c.MODEL.TYPE} is a convolution kernel (4-D), which it does not take; use "
        "sgd, adamw or lamb",
    )
    require(0 < o.LAYER_DECAY <= 1, "OPTIM.LAYER_DECAY", f"must be in (0, 1], got {o.LAYER_DECAY}")
    _check_ns_steps(c.MUON.NS_STEPS)
    _check_warmup_and_decay(o)
    if is_library_optimizer(o.OPTIMIZER):
        _check_library_optimizer(c)
    # (OPTIM.LAYER_DECAY with FairScale: the engine x feature rule, pycls.engines.support)


def _check_optimizer_name(name):
    if name in OWN or name == SCHEDULE_FREE or timm_name(name) in TIMM_OPTIMIZERS:
        return
    close = closest_names(name)
    hint = f"; closest: {', '.join(close)}" if close else ""
    require(
        False,
        "OPTIM.OPTIMIZER",
        f"{show(name)} is not one of {list(OWN)}, {SCHEDULE_FREE!r} or timm:NAME with a name of "
        f"pycls.optim.library_names.TIMM_OPTIMIZERS{hint}",
    )


def _check_warmup_and_decay(o):
    require(
        not (o.WARMUP_STEPS > 0 and o.WARMUP_EPOCHS > 0),
        "OPTIM.WARMUP_STEPS",
        f"{o.WARMUP_STEPS} steps and OPTIM.WARMUP_EPOCHS {o.WARMUP_EPOCHS}: the warmup is counted "
        "in one of them; set the other to 0",
    )
    if o.WEIGHT_DECAY_SCALE == "schedule":
        require(
            o.LR_SCALE_BATCH == 0 and o.BASE_LR > 0,
            "OPTIM.WEIGHT_DECAY_SCALE",
            f"'schedule' multiplies the decay by the rate over OPTIM.BASE_LR (now {o.BASE_LR}), "
            f"which needs BASE_LR > 0 and OPTIM.LR_SCALE_BATCH 0 (now {o.LR_SCALE_BATCH}: the "
            "batch's scaling would scale the decay too)",
        )


def _check_library_optimizer(c):
    """What another library's optimizer cannot do: master weights, pycls's flat buffers; what
    Schedule-Free replaces (the decaying schedule); what FSDP2's shards break."""
    o, name = c.OPTIM, c.OPTIM.OPTIMIZER
    require(
        c.AMP.LEVEL in ("O0", "O1"),
        "OPTIM.OPTIMIZER",
        f"{name} keeps no fp32 master weights, which AMP.LEVEL {c.AMP.LEVEL} needs (its weights "
        "are half precision); use AMP.LEVEL O1 (autocast over fp32 weights)",
    )
    require(
        not o.CONTIGUOUS_PARAMS,
        "OPTIM.CONTIGUOUS_PARAMS",
        f"the flat buffers are pycls's own optimizers', not {name}'s; set it False",
    )
    if name == SCHEDULE_FREE:
        require(
            o.LR_POLICY == "constant",
            "OPTIM.LR_POLICY",
            f"{o.LR_POLICY!r} decays the rate, which Schedule-Free AdamW (OPTIM.OPTIMIZER "
            f"{SCHEDULE_FREE}) replaces by averaging its iterates: use 'constant' (a warmup, "
            "OPTIM.WARMUP_EPOCHS or WARMUP_STEPS, still applies)",
        )
    why = TIMM_NOT_UNDER_FSDP.get(timm_name(name))
    require(
        why is None or c.TRAIN.PARALLEL != "fsdp" or c.FSDP.BACKEND != "torch",
        "OPTIM.OPTIMIZER",
        f"{name} cannot step FSDP2's sharded parameters (TRAIN.PARALLEL fsdp, FSDP.BACKEND "
        f"torch): {why}; use TRAIN.PARALLEL ddp, or another optimizer",
    )


def _check_ns_steps(steps):
    most = max_ns_steps()
    require(
        most >= steps,
        "MUON.NS_STEPS",
        f"{steps} Newton-Schulz steps: after {most} every singular value a bfloat16 iteration "
        "holds has reached its band (the smallest grows 3.4445 times a step), and each step more "
        "costs three matrix products per matrix and changes nothing",
    )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    "LAMB": ("OPTIM.OPTIMIZER", lambda c: c.OPTIM.OPTIMIZER == "lamb"),
    "Muon": ("OPTIM.OPTIMIZER", lambda c: c.OPTIM.OPTIMIZER == "muon"),
    "gradient clipping": ("OPTIM.CLIP_GRAD", lambda c: c.OPTIM.CLIP_GRAD > 0),
    "contiguous params": ("OPTIM.CONTIGUOUS_PARAMS", lambda c: c.OPTIM.CONTIGUOUS_PARAMS),
    "one-pass AdamW": ("OPTIM.ONE_PASS", lambda c: c.OPTIM.ONE_PASS),
    "layer decay": ("OPTIM.LAYER_DECAY", lambda c: c.OPTIM.LAYER_DECAY != 1),
    "Schedule-Free AdamW": ("OPTIM.OPTIMIZER", lambda c: c.OPTIM.OPTIMIZER == SCHEDULE_FREE),
    "timm optimizers": ("OPTIM.OPTIMIZER", lambda c: timm_name(c.OPTIM.OPTIMIZER) is not None),
}


# ------------------------------------------------------------------------------------------------ #
# What the keys become
# ------------------------------------------------------------------------------------------------ #
# pycls.optim.OptimizerSettings (layer decay over the ViT's blocks)
OPTIMIZER_SETTINGS = {
    "name": lambda c: c.OPTIM.OPTIMIZER,
    "lr": lambda c: c.OPTIM.BASE_LR,
    "weight_decay": lambda c: c.OPTIM.WEIGHT_DECAY,
    "weight_decay_scale": lambda c: c.OPTIM.WEIGHT_DECAY_SCALE,
    "no_decay_weight_decay": lambda c: c.OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP,
    "layer_decay": lambda c: c.OPTIM.LAYER_DECAY,
    "depth": lambda c: c.VIT.DEPTH,
    "momentum": lambda c: c.OPTIM.MOMENTUM,
    "dampening": lambda c: c.OPTIM.DAMPENING,
    "nesterov": lambda c: c.OPTIM.NESTEROV,
    "betas": lambda c: tuple(c.OPTIM.BETAS),
    "eps": lambda c: c.OPTIM.EPS,
    "contiguous": lambda c: c.OPTIM.CONTIGUOUS_PARAMS,
    "one_pass": lambda c: c.OPTIM.ONE_PASS,
    "muon_lr_mult": lambda c: c.MUON.LR_MULT,
    "muon_weight_decay": lambda c: c.MUON.WEIGHT_DECAY,
    "muon_momentum": lambda c: c.MUON.MOMENTUM,
    "muon_nesterov": lambda c: c.MUON.NESTEROV,
    "muon_ns_steps": lambda c: c.MUON.NS_STEPS,
    "muon_adjust_lr": lambda c: c.MUON.ADJUST_LR,
}
# pycls.core.schedules.LRSchedule, before the linear scaling rule (OPTIM.LR_SCALE_BATCH), which
# the builder applies for the run's global batch
LR_SCHEDULE_ARGS = {
    "base_lr": lambda c: c.OPTIM.BASE_LR,
    "min_lr": lambda c: c.OPTIM.MIN_LR,
    "max_epoch": lambda c: c.OPTIM.MAX_EPOCH,
    "policy": lambda c: c.OPTIM.LR_POLICY,
    "steps": lambda c: c.OPTIM.STEPS,
    "lr_mult": lambda c: c.OPTIM.LR_MULT,
    "warmup_epochs": lambda c: c.OPTIM.WARMUP_EPOCHS,
    "warmup_factor": lambda c: c.OPTIM.WARMUP_FACTOR,
    "onecycle_pct_start": lambda c: c.OPTIM.ONECYCLE_PCT_START,
    "onecycle_div_factor": lambda c: c.OPTIM.ONECYCLE_DIV_FACTOR,
    "cycle_epochs": lambda c: c.OPTIM.CYCLE_EPOCHS,
    "warmup_steps": lambda c: c.OPTIM.WARMUP_STEPS,
    "warmup_prefix": lambda c: c.OPTIM.WARMUP_PREFIX,
}
