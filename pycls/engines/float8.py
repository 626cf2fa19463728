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

from torch import nn

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
# The classifier heads keep the run's precision, whatever their shape
NEVER_CONVERTED = ("head", "head_dist", "pre_logits")


def eligible(module, name, min_dim):
    """Whether the layer ``name`` (a ``module`` of the model) is converted: an nn.Linear outside
    the heads whose sides are both at least ``min_dim`` and multiples of 16."""
    if type(module) is not nn.Linear or name.split(".")[0] in NEVER_CONVERTED:
        return False
    sides = (module.in_features, module.out_features)
    return all(s % 16 == 0 and s >= min_dim for s in sides)


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
    kept = sorted(set(linears) - set(chosen))
    _log(recipe, min_dim, chosen, kept, linears)
    return chosen


def _log(recipe, min_dim, chosen, kept, linears):
    def shapes(names):
        counts = {}
        for n in names:
            key = (linears[n].in_features, linears[n].out_features)
            counts[key] = counts.get(key, 0) + 1
        return ", ".join(f"{c} x {i}->{o}" for (i, o), c in sorted(counts.items())) or "none"

    logger.info(
        f"AMP.FLOAT8 {recipe}: {len(chosen)} of {len(linears)} linear layers in float8 "
        f"({shapes(chosen)}); kept as they were ({shapes(kept)}: a side below AMP.FLOAT8_MIN_DIM "
        f"{min_dim}, not a multiple of 16, or a head)"
    )
    if chosen:
        logger.info(f"AMP.FLOAT8: converted {', '.join(chosen)}")
    else:
        logger.warning(
            f"AMP.FLOAT8 {recipe} converts no layer of this model: every linear layer has a "
            f"side below AMP.FLOAT8_MIN_DIM {min_dim} (0 converts every layer whose sides are "
            "multiples of 16; docs/float8.md has the measurements)"
        )


def precompute_scales(model):
    """The float8 scales of every FSDP2-sharded tensorwise weight for the next all-gather, in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); call after each
    optimizer step."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
