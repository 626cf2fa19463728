"""Groups of a model's parameters, from their names and modules: which take no weight decay,
which layer each belongs to (layer-wise learning-rate decay), which a fine-tuning freezes.

Layer ids follow BEiT and MAE fine-tuning: the embedding (patch projection, class and register
tokens, position embedding, ``norm_pre``) is layer 0, block i is layer i + 1, and everything after
the blocks (final norm, ``fc_norm``, pre-logits, head) is layer depth + 1. With decay d, layer l
trains at ``d ** (depth + 1 - l)`` times the base rate: the head at the base rate, block i at
``d ** (depth - i)``, the embedding at the smallest, ``d ** (depth + 1)``.

Ids come from parameter names, so they survive the wrappers that keep names (DDP, FSDP2,
torch.compile, the pipeline's chunks, which keep the blocks' global indices).
"""

import re

from torch import nn

# Normalisation layers: their parameters take no weight decay (the model's and the optimizer's
# rule both use this tuple), and they stay in fp32 under AMP O2 (pycls.engines.precision)
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)

_EMBEDDING = (
    "patch_embed",
    "class_token",
    "dist_token",
    "register_tokens",
    "pos_embed",
    "norm_pre",
)
_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def layer_id(name: str, depth: int) -> int:
    """Layer of the parameter called ``name`` in a ViT of ``depth`` blocks (see module doc)."""
    match = _BLOCK.search(name)
    if match:
        return int(match.group(1)) + 1
    parts = name.split(".")
    if any(part in _EMBEDDING for part in parts):
        return 0
    return depth + 1


def lr_scale(layer: int, depth: int, decay: float) -> float:
    """Multiplier of the base rate for ``layer``: ``decay ** (depth + 1 - layer)``."""
    return decay ** (depth + 1 - layer)


def parse_freeze(value: str, depth: int) -> int | None:
    """TRAIN.FREEZE as the number of trainable last blocks: None for "none" (train all), 0 for
    "head", k for "last_k"; ValueError naming the key for anything else."""
    if value == "none":
        return None
    if value == "head":
        return 0
    match = re.fullmatch(r"last_(\d+)", value)
    if match and 1 <= int(match.group(1)) <= depth:
        return int(match.group(1))
    raise ValueError(
        f"TRAIN.FREEZE: {value!r} is not 'none', 'head' or 'last_K' with 1 <= K <= "
        f"VIT.DEPTH={depth}"
    )


def freeze(model, value: str, depth: int) -> list[str]:
    """Applies TRAIN.FREEZE: turns off gradients of everything before the trainable part.

    "head" leaves the classifier (``head``, a distilled ViT's ``head_dist``, ``pre_logits``)
    trainable, a linear probe when there is no pre-logits layer; "last_k" also the last k blocks
    and the final norms. Returns
    the names of the frozen parameters. Call it before the optimizer and the parallel engine
    are built: both only take parameters that require gradients.
    """
    keep_blocks = parse_freeze(value, depth)
    if keep_blocks is None:
        return []
    frozen = []
    for name, p in model.named_parameters():
        layer = layer_id(name, depth)
        if keep_blocks == 0:
            trainable = name.split(".")[0] in ("head", "head_dist", "pre_logits")
        else:
            trainable = layer > depth - keep_blocks
        if not trainable:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def no_weight_decay_names(model):
    """Names of parameters that take no weight decay: norms, biases, embeddings and tokens.

    A model may declare its own through ``no_weight_decay_names()``; otherwise every parameter of
    a normalisation layer and every 1-d parameter (biases, scales) is excluded.
    """
    if hasattr(model, "no_weight_decay_names"):
        return set(model.no_weight_decay_names())
    names = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if isinstance(module, NORM_TYPES) or p.ndim <= 1:
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def hidden_matrix_names(model):
    """Names of the hidden 2-D weights: the matrices inside the transformer blocks (attention and
    feed-forward projections), which Muon orthogonalises. The patch embedding, the head, the
    position embedding and the tokens sit outside the blocks; norms and biases are not 2-D.
    From the names, so FSDP2, DDP and torch.compile (which keep them) change nothing."""
    return {n for n, p in model.named_parameters() if p.ndim == 2 and _BLOCK.search(n)}
