"""AMP.FLOAT8: the model's large linear layers computing in float8, through torchao's conversion
(``torchao.float8.convert_to_float8_training``: each chosen ``nn.Linear`` becomes a
``Float8Linear``, its weight, input and output gradient cast to float8 with dynamic scales around
every matmul; the weights themselves stay as they were, fp32 or half).

- "tensorwise": one scale per tensor. Under FSDP2 the weights are all-gathered in float8 (half of
  bfloat16's bytes; torchao's ``enable_fsdp_float8_all_gather``), their scales computed for all
  layers in one all-reduce after each optimizer step (``precompute_scales``).
- "rowwise": one scale per row (per column for the right operand): closer to bfloat16's accuracy
  where a tensor's rows differ in range, more casting work; gathered in bfloat16.

Which layers: float8 only pays where the matmul outweighs the casts around it. torchao's
microbenchmarks on an H100 put a (M, K, N) = (1024, 2048, 1024) matmul at 0.80x of bfloat16's
speed and a (4096, 8192, 16384) one at 1.39x; users report float8 slower than bfloat16 when
applied to every layer. A layer is converted when both its sides (in and out features) are at
least ``min_dim`` (AMP.FLOAT8_MIN_DIM, 2048 by default: above the slower shape's 1024, below the
faster's 8192) and multiples of 16 (the float8 matmul's requirement); the classifier heads are
never converted (the logits keep the run's precision). The log lists what was converted.

Checkpoints are unchanged: a Float8Linear holds the same ``weight`` and ``bias`` as the Linear it
replaced, so a float8 run's weights load into a model of any precision. torchao is an optional
package (``pip install torchao``, the extra ``pycls-vit[float8]``), imported here only.
"""

import dataclasses
import logging
import re

from torch import nn

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
# The classifier heads keep the run's precision, whatever their shape
NEVER_CONVERTED = ("head", "head_dist", "pre_logits")


def why_kept(module, name, min_dim):
    """Why the layer ``name`` (a ``module`` of the model) stays as it is ("" if it is converted:
    an nn.Linear outside the heads whose sides are both at least ``min_dim`` and multiples of
    16)."""
    if type(module) is not nn.Linear:
        return "not a plain nn.Linear"
    if name.split(".")[0] in NEVER_CONVERTED:
        return "a head"
    sides = (module.in_features, module.out_features)
    if any(side % 16 for side in sides):
        return "a side not a multiple of 16"
    if min(sides) < min_dim:
        return f"a side below AMP.FLOAT8_MIN_DIM {min_dim}"
    return ""


def eligible(module, name, min_dim):
    """Whether the layer ``name`` (a ``module`` of the model) is converted (see ``why_kept``)."""
    return not why_kept(module, name, min_dim)


def _torchao():
    try:
        import torchao.float8  # optional: only AMP.FLOAT8 needs torchao
    except ImportError:
        raise ImportError(
            "AMP.FLOAT8 needs the torchao package: pip install torchao (or pycls-vit[float8])"
        ) from None
    return torchao.float8


def convert(model, recipe, min_dim, fsdp_all_gather=False):
    """Converts ``model``'s eligible linear layers to float8 in place (``recipe`` "tensorwise" or
    "rowwise"; ``fsdp_all_gather``: tensorwise weights all-gathered in float8 under FSDP2);
    returns the names of the converted layers, logged with those left as they were."""
    if recipe not in RECIPES:
        raise ValueError(f"AMP.FLOAT8 {recipe!r} is not one of {['none', *RECIPES]}")
    f8 = _torchao()
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather and recipe == "tensorwise":  # rowwise scales cannot gather in float8
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = [n for n, m in linears.items() if eligible(m, n, min_dim)]
    if chosen:
        f8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, n: n in chosen
        )
    kept = {n: why_kept(m, n, min_dim) for n, m in linears.items() if n not in chosen}
    _log(recipe, min_dim, chosen, kept, linears)
    return chosen


def _shapes(names, linears):
    """ "24 x 1024->4096, ..." for the layers called ``names``."""
    counts = {}
    for n in names:
        key = (linears[n].in_features, linears[n].out_features)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{c} x {i}->{o}" for (i, o), c in sorted(counts.items()))


def _compact(names):
    """Layer names with the block index folded: "blocks 0-23: attn.qkv, ffn.fc1"."""
    by_part, others = {}, []
    for n in names:
        match = re.fullmatch(r"blocks\.(\d+)\.(.+)", n)
        if match:
            by_part.setdefault(match.group(2), []).append(int(match.group(1)))
        else:
            others.append(n)
    by_blocks = {}
    for part, blocks in by_part.items():
        blocks = sorted(blocks)
        span = _ranges(blocks)
        by_blocks.setdefault(span, []).append(part)
    folded = [f"blocks {span}: {', '.join(parts)}" for span, parts in by_blocks.items()]
    return "; ".join(folded + others)


def _ranges(numbers):
    """ "0-23" or "0-3, 8" for sorted integers."""
    spans, start = [], numbers[0]
    for prev, cur in zip(numbers, numbers[1:] + [None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def _log(recipe, min_dim, chosen, kept, linears):
    reasons = {}
    for name, reason in kept.items():
        reasons.setdefault(reason, []).append(name)
    left = "; ".join(f"{_shapes(names, linears)} ({why})" for why, names in reasons.items())
    logger.info(
        f"AMP.FLOAT8 {recipe}: {len(chosen)} of {len(linears)} linear layers in float8"
        + (f": {_compact(chosen)} ({_shapes(chosen, linears)})" if chosen else "")
        + (f"; kept as they were: {left}" if left else "")
    )
    if not chosen:
        logger.warning(
            f"AMP.FLOAT8 {recipe} converts no layer of this model: every linear layer has a "
            f"side below AMP.FLOAT8_MIN_DIM {min_dim} or is a head (0 converts every layer whose "
            "sides are multiples of 16; docs/float8.md)"
        )


def precompute_scales(model):
    """The float8 scales of every FSDP2-sharded tensorwise weight for the next all-gather, in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); call after each
    optimizer step."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
