"""Which layer a parameter belongs to, from its name: layer-wise learning-rate decay and the
trainable part of a fine-tuning (TRAIN.FREEZE). Plain Python, no torch (the config checks
TRAIN.FREEZE with ``parse_freeze`` when it loads).

Layer ids follow BEiT and MAE fine-tuning: the embedding (patch projection, class and register
tokens, position embedding, ``norm_pre``) is layer 0, block i is layer i + 1, and everything after
the blocks (final norm, ``fc_norm``, pre-logits, head) is layer depth + 1. With decay d, layer l
trains at ``d ** (depth + 1 - l)`` times the base rate: the head at the base rate, block i at
``d ** (depth - i)``, the embedding at the smallest, ``d ** (depth + 1)``.

Ids come from parameter names, so they survive the wrappers that keep names (DDP, FSDP2,
torch.compile, the pipeline's chunks, which keep the blocks' global indices).
"""

import re

__all__ = ["layer_id", "lr_scale", "parse_freeze"]

_EMBEDDING = (
    "patch_embed",
    "class_token",
    "dist_token",
    "register_tokens",
    "pos_embed",
    "norm_pre",
)
BLOCK_NAME = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def layer_id(name: str, depth: int) -> int:
    """Layer of the parameter called ``name`` in a ViT of ``depth`` blocks (see module doc)."""
    match = BLOCK_NAME.search(name)
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
    """A fine-tuning's freeze (TRAIN.FREEZE) as the number of trainable last blocks: None for
    "none" (train all), 0 for "head", k for "last_k"; ValueError for anything else."""
    if value == "none":
        return None
    if value == "head":
        return 0
    match = re.fullmatch(r"last_(\d+)", value)
    if match and 1 <= int(match.group(1)) <= depth:
        return int(match.group(1))
    raise ValueError(
        f"freeze {value!r} is not 'none', 'head' or 'last_K' with 1 <= K <= the {depth} blocks"
    )
