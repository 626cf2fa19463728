"""``OptimizerSettings``: what an optimizer is asked to do, as plain values, each option declared
once (``pycls.options.option``): the config's OPTIM and MUON keys that build the optimizer are
generated from these fields (``pycls.config.sections.optimization``), which the builders fill;
``pycls.optim.optimizer_settings.optimizer_from_settings`` builds the optimizer. Also the names
the schedule's policy takes (OPTIM.LR_POLICY: ``pycls.core.schedules``). Plain Python, no torch:
the config reads the values here.
"""

from dataclasses import dataclass

from pycls.options import Feature, Key, ReadFrom, option

# What the weight decay is multiplied by at each step (OptimizerSettings.weight_decay_scale)
WEIGHT_DECAY_SCALES = ("lr", "schedule")
# How Muon scales each matrix's orthogonalised update for its shape (pycls.optim.muon)
MUON_ADJUST_LRS = ("match_rms_adamw", "original")
# The learning-rate schedule after warmup (pycls.core.schedules.LRSchedule), updated every iteration
LR_POLICIES = ("cos", "lin", "steps", "constant", "onecycle", "cyclic")

# Why the MUON keys drop their fields' prefix
_MUON = "in the MUON group, which the field's muon_ prefix names"


@dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer is made of, as plain values (the OPTIM and MUON keys)."""

    name: str = option(
        "adamw",
        "Optimizer: pycls's fused sgd, adamw, lamb or muon (a ViT's hidden 2-D weights on Muon, "
        "everything else on AdamW; see MUON); schedulefree_adamw (Schedule-Free AdamW, the "
        "schedulefree package: LR_POLICY constant, its evaluation and checkpoints use its averaged "
        "weights); or timm:NAME, an optimizer of timm's registry (timm:lion, timm:laprop, "
        "timm:mars, ...: pycls.optim.library_names lists them), given OPTIM.BETAS, EPS and "
        "MOMENTUM where it takes them. Other libraries' optimizers need AMP.LEVEL O0 or O1 and "
        "CONTIGUOUS_PARAMS False",
        key=Key("OPTIMIZER", why="upstream pycls's name"),
    )
    lr: float = option(
        1e-3,
        "Learning rate at the end of warmup (for the schedule's reference batch, see "
        "OPTIM.LR_SCALE_BATCH)",
        bounds="non_negative",
        key=Key("BASE_LR", why="upstream pycls's name: the schedule's base, before scaling"),
    )
    weight_decay: float = option(
        0.05,
        "Decoupled weight decay (AdamW, LAMB) or L2 (SGD) for weight matrices",
        bounds="non_negative",
    )
    weight_decay_scale: str = option(
        "lr",
        "What the weight decay is multiplied by at each step: lr = the group's scheduled rate "
        "(torch's AdamW: the weights shrink by lr x WEIGHT_DECAY); schedule = the schedule's "
        "factor only, the rate over BASE_LR (big_vision and optax: WEIGHT_DECAY 1e-4 at BASE_LR "
        "1e-3 is torch's 0.1, and OPTIM.LAYER_DECAY scales the rates, not the decay). Needs "
        "LR_SCALE_BATCH 0",
        choices=WEIGHT_DECAY_SCALES,
    )
    no_decay_weight_decay: float = option(
        0.0,
        "Weight decay for norms, biases, position embedding and class token (0 in every modern "
        "recipe)",
        bounds="non_negative",
        key=Key("WEIGHT_DECAY_NO_DECAY_GROUP", why="named for the no-decay group it decays"),
    )
    layer_decay: float = option(
        1.0,
        "Layer-wise learning-rate decay (BEiT/MAE fine-tuning), in (0, 1]: the head trains at the "
        "scheduled rate, block i (0-based) at LAYER_DECAY ** (VIT.DEPTH - i) times it, the "
        "embedding at LAYER_DECAY ** (VIT.DEPTH + 1); 1 = the same rate everywhere",
        feature="layer decay",
    )
    depth: int = option(0, "The blocks layer decay counts over", key=ReadFrom("VIT.DEPTH"))
    momentum: float = option(0.9, "SGD momentum", bounds="non_negative")
    dampening: float = option(0.0, "SGD dampening", bounds="non_negative")
    nesterov: bool = option(True, "SGD with Nesterov momentum")
    betas: tuple = option((0.9, 0.999), "Adam-family betas (AdamW, LAMB, Muon's AdamW groups)")
    eps: float = option(1e-8, "Adam-family epsilon (AdamW and LAMB)", bounds="non_negative")
    contiguous: bool = option(
        False,
        "Keep parameters and gradients as views into one flat buffer per group and dtype, so each "
        "fused update is one kernel call over the buffer instead of one per tensor. Equal speed "
        "on one CPU thread; on two threads of a busy CPU several times faster, because a "
        "per-tensor update waits at one thread barrier per tensor (BENCHMARKS.md)",
        key=Key("CONTIGUOUS_PARAMS", why="says what is contiguous"),
        feature="contiguous params",
    )
    one_pass: bool = option(
        False,
        "AdamW's step as ONE compiled pass over those flat buffers (pycls.optim.one_pass): the "
        "update, O2's fp32 master weights rounded into the model's half weights, the EMA "
        "(TRAIN.EMA) when it falls due and the gradients' zeroing, each element read and written "
        "once, compiled by inductor on every device (a CPU too: the first step compiles for "
        "seconds). Needs OPTIM.OPTIMIZER adamw and CONTIGUOUS_PARAMS True, under TRAIN.PARALLEL "
        "none or ddp; layer decay, clipping and float16 loss scaling work as without it "
        "(docs/recipes.md)",
        feature=Feature("one-pass AdamW"),
    )
    muon_lr_mult: float = option(
        1.0,
        "The Muon matrices' learning rate as a multiple of the scheduled rate (1 with ADJUST_LR "
        "match_rms_adamw, Moonlight's recipe: AdamW's rate carries over; about 0.02 / "
        "OPTIM.BASE_LR with original, Keller Jordan's)",
        bounds="positive",
        key=Key("LR_MULT", group="MUON", why=_MUON),
    )
    muon_weight_decay: float = option(
        0.05,
        "Decoupled weight decay of the Muon matrices (Moonlight: AdamW's)",
        bounds="non_negative",
        key=Key("WEIGHT_DECAY", group="MUON", why=_MUON),
    )
    muon_momentum: float = option(
        0.95,
        "Momentum of the gradient before it is orthogonalised",
        bounds="rate",
        key=Key("MOMENTUM", group="MUON", why=_MUON),
    )
    muon_nesterov: bool = option(
        True,
        "Nesterov's form of Muon's momentum",
        key=Key("NESTEROV", group="MUON", why=_MUON),
    )
    muon_ns_steps: int = option(
        5,
        "Newton-Schulz iterations of the orthogonalisation (torch.optim.Muon's default). At most "
        "71: after that many every singular value the bfloat16 iteration holds has reached its "
        "band",
        bounds="positive",
        key=Key("NS_STEPS", group="MUON", why=_MUON),
    )
    muon_adjust_lr: str = option(
        "match_rms_adamw",
        "Scale of each matrix's update by its shape (out, in): match_rms_adamw 0.2 * sqrt(max(out, "
        "in)) (the update's RMS is AdamW's) or original sqrt(max(1, out / in))",
        choices=MUON_ADJUST_LRS,
        key=Key("ADJUST_LR", group="MUON", why=_MUON),
    )


@dataclass(frozen=True)
class LRScheduleSettings:
    """The learning rate over training (the OPTIM keys of ``pycls.core.schedules.LRSchedule``,
    before the linear scaling rule, OPTIM.LR_SCALE_BATCH, which the builder applies for the run's
    global batch)."""

    base_lr: float = option(1e-3, "The rate at the end of warmup", key=ReadFrom("OPTIM.BASE_LR"))
    min_lr: float = option(
        1e-5,
        "Learning rate the schedule decays to (cosine and linear schedules)",
        bounds="non_negative",
    )
    max_epoch: int = option(100, "Number of training epochs", bounds="positive")
    policy: str = option(
        "cos",
        "Schedule after warmup: cos, lin, steps, constant, onecycle or cyclic; updated every "
        "iteration",
        choices=LR_POLICIES,
        key=Key("LR_POLICY", why="upstream pycls's name"),
    )
    steps: tuple = option((), "steps schedule: epochs at which the rate is multiplied by LR_MULT")
    lr_mult: float = option(0.1, "steps schedule: the factor at each of STEPS", bounds="positive")
    warmup_epochs: float = option(
        0.0,
        "Warmup: the rate rises linearly from WARMUP_FACTOR * BASE_LR to the schedule over "
        "WARMUP_EPOCHS (fractional epochs allowed)",
        bounds="non_negative",
    )
    warmup_factor: float = option(
        0.01, "The warmup's first rate as a fraction of BASE_LR", bounds="non_negative"
    )
    onecycle_pct_start: float = option(
        0.3,
        "onecycle: fraction of training spent rising from BASE_LR / ONECYCLE_DIV_FACTOR to "
        "BASE_LR, then cosine annealing to MIN_LR",
    )
    onecycle_div_factor: float = option(25.0, "onecycle: BASE_LR over the rate it starts at")
    cycle_epochs: float = option(
        10.0, "cyclic: triangular cycles between MIN_LR and BASE_LR, each this many epochs long"
    )
    warmup_steps: int = option(
        0,
        "Warmup counted in optimizer steps instead (0 = WARMUP_EPOCHS'), as big_vision and optax "
        "count it: the epochs it spans follow from the steps per epoch (the training set over the "
        "batch)",
        bounds="non_negative",
    )
    warmup_prefix: bool = option(
        False,
        "Where the decay of cos, lin and onecycle starts: False = at epoch 0, spanning the whole "
        "run (the warmup ramp multiplies its start); True = where the warmup ends, spanning the "
        "epochs after it (big_vision's schedule, timm's warmup_prefix): the rate peaks at BASE_LR",
    )
