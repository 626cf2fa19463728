"""Which features each engine supports: the one rule, read by the config check
(``pycls.config.validation``) and rendered into the engines table of docs/distributed.md
(``markdown_table``). The features are the config's (each section declares the features its keys
turn on: ``pycls.config.sections``); a pair not listed in ``UNSUPPORTED`` works. Plain data and
functions, no imports from pycls.
"""

# Engine name -> how the config selects it
ENGINES = {
    "none": "TRAIN.PARALLEL none",
    "ddp": "TRAIN.PARALLEL ddp",
    "fsdp": "TRAIN.PARALLEL fsdp",
    "fairscale": "TRAIN.PARALLEL fsdp with FSDP.BACKEND fairscale",
    "pipeline": "TRAIN.PARALLEL pipeline",
    "tensor": "TRAIN.PARALLEL tensor",
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

_STAGE_SHAPES = (
    "the pipeline's stages exchange tensors of one shape per batch shape, and the number of "
    "tokens that crosses them would change with the patches kept or the images' grids; use none, "
    "ddp or fsdp"
)

_SEQUENCE_SHARDS = (
    "the tensor-parallel plan splits the blocks' tokens into sequence shards, and {what}"
    "; use none, ddp or fsdp"
)

_LIBRARY_OPTIMIZER = (
    "untested: another library's optimizer over {what}; use TRAIN.PARALLEL none, ddp or fsdp"
)

# (engine, feature) -> why the pair cannot work. Every pair not listed works.
UNSUPPORTED = {
    ("fsdp", "curriculum"): _RESAMPLES.format(holds="shards over processes"),
    ("fairscale", "curriculum"): _RESAMPLES.format(holds="flattens and shards"),
    ("pipeline", "curriculum"): _RESAMPLES.format(holds="splits over processes"),
    ("tensor", "curriculum"): _RESAMPLES.format(holds="shards over processes"),
    ("fsdp", "contiguous params"): _OWNS_STORAGE,
    ("tensor", "contiguous params"): _OWNS_STORAGE,
    ("fairscale", "contiguous params"): _OWNS_STORAGE,
    ("fsdp", "one-pass AdamW"): _OWNS_STORAGE,
    ("tensor", "one-pass AdamW"): _OWNS_STORAGE,
    ("fairscale", "one-pass AdamW"): _OWNS_STORAGE,
    ("pipeline", "one-pass AdamW"): (
        "untested over the pipeline's stage modules (the pass is tested under TRAIN.PARALLEL none "
        "and ddp); set it False"
    ),
    ("fairscale", "LAMB"): (
        "FairScale shards flat parameters (a block's weights concatenated, then split over "
        "processes), so LAMB's trust ratio would be one per shard, not one per tensor; use "
        "FSDP.BACKEND torch or another optimizer"
    ),
    ("fairscale", "Muon"): (
        "FairScale shards flat parameters (a block's weights concatenated, then split over "
        "processes), so no process holds a weight matrix to orthogonalise; use FSDP.BACKEND torch, "
        "whose shards Muon gathers into whole matrices"
    ),
    ("pipeline", "distillation"): (
        "the pipeline's last stage computes the loss from the logits alone, where the teacher's "
        "predictions of each micro-batch would have to reach it; use TRAIN.PARALLEL none, ddp or "
        "fsdp"
    ),
    ("tensor", "distillation"): (
        "the processes of a tensor-parallel group gather their shards of a batch inside the "
        "engine, so the student's logits cover the group's batch where the teacher predicted this "
        "process's shard; use TRAIN.PARALLEL none, ddp or fsdp"
    ),
    ("pipeline", "distillation token"): (
        "the pipeline's stages hold the class and register tokens and the one head, not the "
        "distillation token and its head; use TRAIN.PARALLEL none, ddp or fsdp"
    ),
    ("tensor", "distillation token"): (
        "the tensor-parallel plan replicates the class and register tokens and the one head, not "
        "the distillation token and its head; use TRAIN.PARALLEL none, ddp or fsdp"
    ),
    ("tensor", "float8"): (
        "untested: torchao's float8 layers under the plan's column- and row-wise DTensors (the "
        "CPU refuses float8, and a tensor-parallel test needs several GPUs); use TRAIN.PARALLEL "
        "none, ddp or fsdp"
    ),
    ("fairscale", "distillation"): (
        "untested with FairScale's wrappers (FairScale needs CUDA); use FSDP.BACKEND torch"
    ),
    ("pipeline", "float8"): (
        "untested: float8 layers inside the pipeline's stages and its schedule; use "
        "TRAIN.PARALLEL none, ddp or fsdp"
    ),
    ("fairscale", "float8"): (
        "FairScale flattens the weights that torchao's float8 layers hold; use FSDP.BACKEND torch "
        "(FSDP2 all-gathers them in float8)"
    ),
    ("fairscale", "layer decay"): (
        "the per-layer learning rates need parameter names, which FairScale flattens; use "
        "FSDP.BACKEND torch"
    ),
    ("fairscale", "Schedule-Free AdamW"): _LIBRARY_OPTIMIZER.format(
        what="FairScale's flattened shards (FairScale needs CUDA)"
    ),
    ("pipeline", "Schedule-Free AdamW"): _LIBRARY_OPTIMIZER.format(what="the pipeline's stages"),
    ("tensor", "Schedule-Free AdamW"): _LIBRARY_OPTIMIZER.format(
        what="the plan's column- and row-wise DTensors"
    ),
    ("fairscale", "timm optimizers"): _LIBRARY_OPTIMIZER.format(
        what="FairScale's flattened shards (FairScale needs CUDA)"
    ),
    ("pipeline", "timm optimizers"): _LIBRARY_OPTIMIZER.format(what="the pipeline's stages"),
    ("tensor", "timm optimizers"): _LIBRARY_OPTIMIZER.format(
        what="the plan's column- and row-wise DTensors"
    ),
    ("pipeline", "CNN families"): (
        "the pipeline cuts a ViT's equal blocks into stages; use TRAIN.PARALLEL none, ddp or fsdp"
    ),
    ("tensor", "CNN families"): (
        "the mesh splits a ViT's attention heads, MLP channels and tokens; use TRAIN.PARALLEL "
        "none, ddp or fsdp"
    ),
    ("fairscale", "CNN families"): (
        "the FairScale engine wraps a ViT's blocks; use FSDP.BACKEND torch (FSDP2 shards the CNN's "
        "residual blocks)"
    ),
    ("pipeline", "precise BN"): (
        "the statistics are recomputed by running the whole model, which the pipeline splits "
        "over processes"
    ),
    ("tensor", "precise BN"): (
        "the statistics are recomputed by running the whole model in each process, which tensor "
        "parallelism splits over processes"
    ),
    ("fairscale", "compile"): (
        "torch.compile through FairScale's FSDP wrappers is untested (FairScale needs CUDA); use "
        "FSDP.BACKEND torch, whose FSDP2 units compile per block"
    ),
    ("tensor", "compile"): (
        "torch.compile of the tensor-parallel blocks (DTensors, a broadcast per stochastic-depth "
        "mask) is untested; set TRAIN.COMPILE False"
    ),
    ("tensor", "whole-model compile"): "see TRAIN.COMPILE: untested under tensor parallelism",
    ("pipeline", "whole-model compile"): (
        "the pipeline runs its stages in a schedule of its own, which a compiled whole model "
        "would never enter; use TRAIN.COMPILE_SCOPE blocks"
    ),
    ("fsdp", "SyncBatchNorm"): "SyncBatchNorm is applied under DDP; use TRAIN.PARALLEL ddp",
    ("fairscale", "SyncBatchNorm"): "SyncBatchNorm is applied under DDP; use TRAIN.PARALLEL ddp",
    ("pipeline", "SyncBatchNorm"): "SyncBatchNorm is applied under DDP; use TRAIN.PARALLEL ddp",
    ("tensor", "SyncBatchNorm"): "SyncBatchNorm is applied under DDP; use TRAIN.PARALLEL ddp",
    ("fsdp", "channels_last"): _FLAT_PARAMS,
    ("fairscale", "channels_last"): _FLAT_PARAMS,
    ("pipeline", "channels_last"): _FLAT_PARAMS,
    ("tensor", "channels_last"): _FLAT_PARAMS,
    ("pipeline", "patch dropout"): _STAGE_SHAPES,
    ("pipeline", "token budget"): _STAGE_SHAPES,
    ("fairscale", "token budget"): (
        "FairScale's wrappers cast and move a batch they know as tensors, not the token batch's "
        "index tensors (untested: FairScale needs CUDA); use FSDP.BACKEND torch"
    ),
    ("tensor", "patch dropout"): _SEQUENCE_SHARDS.format(
        what="the kept patches are gathered from replicated tokens by a plain index"
    ),
    ("tensor", "token budget"): _SEQUENCE_SHARDS.format(
        what="a token batch's index tensors and attention masks are not cut into sequence shards"
    ),
    ("tensor", "drop-path skip"): _SEQUENCE_SHARDS.format(
        what="each process would draw its own kept samples (only the multiply mask is shared)"
    ),
    ("fairscale", "bfloat16 residual"): (
        "untested with FairScale's wrappers, which cast the inputs of each of their units "
        "(FairScale needs CUDA); use FSDP.BACKEND torch"
    ),
    ("fairscale", "attention backend"): (
        "untested with FairScale's wrappers (FairScale needs CUDA); use FSDP.BACKEND torch"
    ),
    ("pipeline", "skip corrupt"): (
        "the processes of a pipeline gather their shards of a batch, which must keep equal sizes"
    ),
    ("tensor", "skip corrupt"): (
        "the processes of a tensor-parallel group gather their shards of a batch, which must keep "
        "equal sizes"
    ),
}


def conflicts(engine, enabled_features):
    """``[(feature key, message)]`` for every feature in ``enabled_features`` ({feature: the key
    that turns it on}) that ``engine`` (a key of ENGINES) does not support; the message names
    both the feature's key and the engine's."""
    out = []
    for feature, key in enabled_features.items():
        reason = UNSUPPORTED.get((engine, feature))
        if reason is not None:
            out.append((key, f"cannot be used with {ENGINES[engine]}: {reason}"))
    return out


def markdown_table(features):
    """The engine x feature table of docs/distributed.md (generated from UNSUPPORTED), one row
    per feature of ``features`` ({feature: the key that turns it on})."""
    names = list(ENGINES)
    lines = [
        "| feature (key) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for feature, key in features.items():
        cells = ["no" if (e, feature) in UNSUPPORTED else "yes" for e in names]
        lines.append(f"| {feature} (`{key}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)
