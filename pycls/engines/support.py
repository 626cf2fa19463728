"""Which features each engine supports: the one rule, read by the config check (config.py) and
rendered into the engines table of docs/distributed.md (``markdown_table``).

Plain data and functions, no imports from pycls, so config.py can read it at load time.
"""

# Engine name -> how the config selects it
ENGINES = {
    "none": "TRAIN.PARALLEL none",
    "ddp": "TRAIN.PARALLEL ddp",
    "fsdp": "TRAIN.PARALLEL fsdp",
    "fairscale": "TRAIN.PARALLEL fsdp with FSDP.BACKEND fairscale",
    "pipeline": "TRAIN.PARALLEL pipeline",
}

# Feature name -> (the key that turns it on, whether the config turns it on)
FEATURES = {
    "EMA": ("TRAIN.EMA", lambda c: c.TRAIN.EMA),
    "curriculum": ("CURRICULUM.ENABLED", lambda c: c.CURRICULUM.ENABLED),
    "accumulation": ("TRAIN.ACCUM_STEPS", lambda c: c.TRAIN.ACCUM_STEPS > 1),
    "AMP": ("AMP.LEVEL", lambda c: c.AMP.LEVEL != "O0"),
    "LAMB": ("OPTIM.OPTIMIZER", lambda c: c.OPTIM.OPTIMIZER == "lamb"),
    "gradient clipping": ("OPTIM.CLIP_GRAD", lambda c: c.OPTIM.CLIP_GRAD > 0),
    "mixup/cutmix": ("MIXUP.ALPHA", lambda c: c.MIXUP.ALPHA > 0 or c.MIXUP.CUTMIX_ALPHA > 0),
    "contiguous params": ("OPTIM.CONTIGUOUS_PARAMS", lambda c: c.OPTIM.CONTIGUOUS_PARAMS),
    "skip corrupt": ("DATA_LOADER.SKIP_CORRUPT", lambda c: c.DATA_LOADER.SKIP_CORRUPT),
    "layer decay": ("OPTIM.LAYER_DECAY", lambda c: c.OPTIM.LAYER_DECAY != 1),
    "CNN families": ("MODEL.TYPE", lambda c: c.MODEL.TYPE != "vit"),
    "precise BN": ("BN.USE_PRECISE_STATS", lambda c: c.BN.USE_PRECISE_STATS),
    "SyncBatchNorm": ("BN.SYNC", lambda c: c.BN.SYNC),
    "compile": ("TRAIN.COMPILE", lambda c: c.TRAIN.COMPILE),
    "whole-model compile": (
        "TRAIN.COMPILE_SCOPE",
        lambda c: c.TRAIN.COMPILE and c.TRAIN.COMPILE_SCOPE == "model",
    ),
    "channels_last": (
        "MODEL.MEMORY_FORMAT",
        lambda c: c.MODEL.MEMORY_FORMAT == "channels_last" and c.MODEL.TYPE != "vit",
    ),
}

_RESAMPLES = (
    "the image-size curriculum resamples the position embedding in place, which this engine "
    "{holds}; use none or ddp"
)
_OWNS_STORAGE = (
    "the engine owns the parameter storage (sharded, flattened) and the optimizer's flat buffers "
    "would replace it; set it False"
)

_FLAT_PARAMS = (
    "channels_last weights are strided, and this engine cuts or moves parameters as flat, "
    "contiguous tensors (untested); use TRAIN.PARALLEL none or ddp"
)

# (engine, feature) -> why the pair cannot work. Every pair not listed works.
UNSUPPORTED = {
    ("fsdp", "curriculum"): _RESAMPLES.format(holds="shards over processes"),
    ("fairscale", "curriculum"): _RESAMPLES.format(holds="flattens and shards"),
    ("pipeline", "curriculum"): _RESAMPLES.format(holds="splits over processes"),
    ("fsdp", "contiguous params"): _OWNS_STORAGE,
    ("fairscale", "contiguous params"): _OWNS_STORAGE,
    ("fairscale", "LAMB"): (
        "FairScale shards flat parameters (a block's weights concatenated, then split over "
        "processes), so LAMB's trust ratio would be one per shard, not one per tensor; use "
        "FSDP.BACKEND torch or another optimizer"
    ),
    ("fairscale", "layer decay"): (
        "the per-layer learning rates need parameter names, which FairScale flattens; use "
        "FSDP.BACKEND torch"
    ),
    ("pipeline", "CNN families"): (
        "the pipeline cuts a ViT's equal blocks into stages; use TRAIN.PARALLEL none, ddp or fsdp"
    ),
    ("fairscale", "CNN families"): (
        "the FairScale engine wraps a ViT's blocks; use FSDP.BACKEND torch (FSDP2 shards the CNN's "
        "residual blocks)"
    ),
    ("pipeline", "precise BN"): (
        "the statistics are recomputed by running the whole model, which the pipeline splits "
        "over processes"
    ),
    ("fairscale", "compile"): (
        "torch.compile through FairScale's FSDP wrappers is untested (FairScale needs CUDA); use "
        "FSDP.BACKEND torch, whose FSDP2 units compile per block"
    ),
    ("pipeline", "whole-model compile"): (
        "the pipeline runs its stages in a schedule of its own, which a compiled whole model "
        "would never enter; use TRAIN.COMPILE_SCOPE blocks"
    ),
    ("fsdp", "SyncBatchNorm"): "SyncBatchNorm is applied under DDP; use TRAIN.PARALLEL ddp",
    ("fairscale", "SyncBatchNorm"): "SyncBatchNorm is applied under DDP; use TRAIN.PARALLEL ddp",
    ("pipeline", "SyncBatchNorm"): "SyncBatchNorm is applied under DDP; use TRAIN.PARALLEL ddp",
    ("fsdp", "channels_last"): _FLAT_PARAMS,
    ("fairscale", "channels_last"): _FLAT_PARAMS,
    ("pipeline", "channels_last"): _FLAT_PARAMS,
    ("pipeline", "skip corrupt"): (
        "the processes of a pipeline gather their shards of a batch, which must keep equal sizes"
    ),
}


def engine_name(cfg):
    """The engine the config selects (a key of ENGINES)."""
    if cfg.TRAIN.PARALLEL == "fsdp" and cfg.FSDP.BACKEND == "fairscale":
        return "fairscale"
    return cfg.TRAIN.PARALLEL


def conflicts(cfg):
    """``[(feature key, message)]`` for every feature the config turns on that its engine does
    not support; the message names both the feature's key and the engine's."""
    engine = engine_name(cfg)
    out = []
    for feature, (key, enabled) in FEATURES.items():
        reason = UNSUPPORTED.get((engine, feature))
        if reason is not None and enabled(cfg):
            out.append((key, f"cannot be used with {ENGINES[engine]}: {reason}"))
    return out


def markdown_table():
    """The engine x feature table of docs/distributed.md (generated from UNSUPPORTED)."""
    names = list(ENGINES)
    lines = [
        "| feature (key) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for feature, (key, _) in FEATURES.items():
        cells = ["no" if (e, feature) in UNSUPPORTED else "yes" for e in names]
        lines.append(f"| {feature} (`{key}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)
