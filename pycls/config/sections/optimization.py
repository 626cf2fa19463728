"""OPTIM and MUON: the optimizer, its learning-rate schedule, and Muon's rates and decays
(docs/muon.md). What the keys become: the optimizer's settings (``OPTIMIZER_SETTINGS``,
``pycls.optim.OptimizerSettings``, whose fields those keys are generated from) and the schedule's
arguments (``LR_SCHEDULE_ARGS``, ``pycls.core.schedules.LRSchedule``).

Muon (OPTIM.OPTIMIZER muon): the matrices inside the ViT's blocks (attention and feed-forward
projections) take Muon's orthogonalised momentum; everything else (patch embedding, head, norms,
biases, position embedding, tokens) takes AdamW at OPTIM.BASE_LR with OPTIM.BETAS, EPS,
WEIGHT_DECAY and WEIGHT_DECAY_NO_DECAY_GROUP. Both follow the one schedule.

Other libraries' optimizers (OPTIM.OPTIMIZER schedulefree_adamw, timm:NAME) train the same
parameter groups on the same schedule; the names the key takes are plain data in
``pycls.optim.library_names``, read here without importing torch or timm (docs/recipes.md).
"""

from pycls.config.records import RecordKeys, joined
from pycls.config.sections.key_checks import require, show
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
from pycls.optim.optimizer_options import LRScheduleSettings, OptimizerSettings

# ------------------------------------------------------------------------------------------------ #
# The keys: generated from the fields of the optimizer's and the schedule's settings records
# (pycls.optim.optimizer_options: OptimizerSettings, LRScheduleSettings), each with its default,
# its meaning and its values; the two that feed neither written here, with a comment above each
# ------------------------------------------------------------------------------------------------ #
OPTIMIZER_RECORD = RecordKeys(OptimizerSettings, "OPTIM", home="optimization")
SCHEDULE_RECORD = RecordKeys(LRScheduleSettings, "OPTIM", home="optimization")
RECORDS = (OPTIMIZER_RECORD, SCHEDULE_RECORD)
_KEYS = joined(*(record.section("optimization") for record in RECORDS))
_C = _KEYS.tree
# The generated keys' reference texts (a hand-written key has its comment above it)
REFERENCE = _KEYS.reference

# Linear LR scaling rule: if > 0, BASE_LR and MIN_LR are for this global batch size and are scaled
# by (global batch / LR_SCALE_BATCH); 0 uses BASE_LR as written
_C.OPTIM.LR_SCALE_BATCH = 0

# Clip the global gradient norm to this value (0 = no clipping)
_C.OPTIM.CLIP_GRAD = 0.0


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = _KEYS.choices
POSITIVE = _KEYS.positive
NON_NEGATIVE = [*_KEYS.non_negative, "OPTIM.LR_SCALE_BATCH", "OPTIM.CLIP_GRAD"]
# ONECYCLE_PCT_START in [0, 1) and [0, 1] as the hand-written tables had it (the field has no
# single bound for the pair)
BELOW_ONE = [*_KEYS.below_one, "OPTIM.ONECYCLE_PCT_START"]
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
    **_KEYS.features,
    "LAMB": ("OPTIM.OPTIMIZER", lambda c: c.OPTIM.OPTIMIZER == "lamb"),
    "Muon": ("OPTIM.OPTIMIZER", lambda c: c.OPTIM.OPTIMIZER == "muon"),
    "gradient clipping": ("OPTIM.CLIP_GRAD", lambda c: c.OPTIM.CLIP_GRAD > 0),
    "Schedule-Free AdamW": ("OPTIM.OPTIMIZER", lambda c: c.OPTIM.OPTIMIZER == SCHEDULE_FREE),
    "timm optimizers": ("OPTIM.OPTIMIZER", lambda c: timm_name(c.OPTIM.OPTIMIZER) is not None),
}


# ------------------------------------------------------------------------------------------------ #
# What the keys become
# ------------------------------------------------------------------------------------------------ #
# pycls.optim.OptimizerSettings (layer decay over the ViT's blocks), one row per argument,
# generated from its fields
OPTIMIZER_SETTINGS = OPTIMIZER_RECORD.arguments
# pycls.core.schedules.LRSchedule (pycls.optim.optimizer_options.LRScheduleSettings), before the
# linear scaling rule (OPTIM.LR_SCALE_BATCH), which the builder applies for the run's global batch
LR_SCHEDULE_ARGS = SCHEDULE_RECORD.arguments
