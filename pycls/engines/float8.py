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
applied to every layer. Two keys choose, one after the other:

1. the shape rule (AMP.FLOAT8_MIN_DIM, ``min_dim``): a layer may be converted when both its sides
   (in and out features) are at least ``min_dim`` (2048 by default: above the slower shape's
   1024, below the faster's 8192) and multiples of 16 (the float8 matmul's requirement); the
   classifier heads never are (the logits keep the run's precision);
2. among those, AMP.FLOAT8_LAYERS (``layers``): "all" of them (as before the key existed),
   "mlp" (each block's feed-forward matrices only: ``ffn.fc1`` and ``ffn.fc2``, a SwiGLU's
   ``ffn.fc1_g`` and ``ffn.fc1_x`` too, and the parallel block's fused ``in_proj`` and
   ``out_proj``, which hold its MLP's) or "auto" (those the roofline of ``float8_gain`` expects to
   gain, at the run's rows M = one process's micro-batch x tokens).

The log lists what was converted and why each other layer was not.

Checkpoints are unchanged: a Float8Linear holds the same ``weight`` and ``bias`` as the Linear it
replaced, so a float8 run's weights load into a model of any precision. torchao is an optional
package (``pip install torchao``, the extra ``pycls-vit[float8]``), imported here only.
"""

import dataclasses
import logging
import re

from torch import nn

from pycls.models.parallel_plans import tokens_per_image

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
# AMP.FLOAT8_LAYERS: which of the layers the shape rule allows are converted
LAYER_CHOICES = ("all", "mlp", "auto")
# The classifier heads keep the run's precision, whatever their shape
NEVER_CONVERTED = ("head", "head_dist", "pre_logits")
# A block's feed-forward layers (AMP.FLOAT8_LAYERS mlp): the MLP's and a packed SwiGLU's fc1 and
# fc2, a SwiGLU's gate and value projections, the parallel block's fused projections (two thirds
# of each are its MLP's at mlp_dim 4 x width)
MLP_LAYERS = ("ffn.fc1", "ffn.fc1_g", "ffn.fc1_x", "ffn.fc2", "in_proj", "out_proj")
# Layers whose input is the attention kernel's output: its float8 scale needs a pass of its own
# (the parallel block's out_proj reads it beside the MLP's activations, and pays for the whole)
AFTER_ATTENTION = ("attn.proj", "out_proj")

# The roofline of AMP.FLOAT8_LAYERS auto, for an H100 SXM. Estimates, to be confirmed by a GPU
# run (docs/float8.md): bfloat16 matmuls measured 782-798 TFLOP/s on H100 and H200; float8 ones
# reach 1,200-1,400 TFLOP/s in training-sized GEMMs (below twice bfloat16); the casts run at the
# device copy's 3.0 TB/s (read + written, measured on an H100).
BF16_MATMUL_FLOPS = 790e12
FLOAT8_MATMUL_FLOPS = 1300e12
CAST_BYTES_PER_SECOND = 3.0e12


def float8_gain(k, n, m, after_attention=False):
    """Seconds a training step saves by running an (m x k) @ (k x n) linear layer in float8
    instead of bfloat16, net of its casts (negative: float8 loses), on the roofline above.

    - Matmuls: 3 per step (forward, input gradient, weight gradient), 2 m k n FLOPs each; each
      takes 1 / FLOAT8_MATMUL_FLOPS instead of 1 / BF16_MATMUL_FLOPS seconds per FLOP.
    - Casts to float8 (read 2 bytes, write 1 per element), each operand once per matmul that
      uses it: the input (m x k) and the output gradient (m x n) twice each, 6 m (k + n) bytes;
      the weight (k x n) twice, 6 k n bytes; and where the input is the attention kernel's
      output (``after_attention``: ``attn.proj``) one more read of it for its scale, 2 m k
      bytes (the other layers' inputs come from a LayerNorm or GELU whose kernel computes the
      scale's maximum on the way, once compiled).

    m cancels but for the weight's casts: a layer gains when 1/k + 1/n (+ 1/m for the weight,
    + 1/(3n) after attention) is below CAST_BYTES_PER_SECOND x (1/BF16 - 1/FLOAT8 FLOP/s): about
    1/650 with the constants above, so both sides must be large, and the square ``attn.proj``
    (k = n) needs the largest width."""
    flops = 6 * m * k * n
    saved = flops * (1 / BF16_MATMUL_FLOPS - 1 / FLOAT8_MATMUL_FLOPS)
    cast_bytes = 6 * m * (k + n) + 6 * k * n + (2 * m * k if after_attention else 0)
    return saved - cast_bytes / CAST_BYTES_PER_SECOND


def why_kept(module, name, min_dim, layers="all", rows=0):
    """Why the layer ``name`` (a ``module`` of the model) stays as it is ("" if it is converted):
    the shape rule first (an nn.Linear outside the heads whose sides are both at least
    ``min_dim`` and multiples of 16), then ``layers`` ("all", "mlp" or "auto", at ``rows`` rows
    of input per micro-batch)."""
    if type(module) is not nn.Linear:
        return "not a plain nn.Linear"
    if name.split(".")[0] in NEVER_CONVERTED:
        return "a head"
    sides = (module.in_features, module.out_features)
    if any(side % 16 for side in sides):
        return "a side not a multiple of 16"
    if min(sides) < min_dim:
        return f"a side below AMP.FLOAT8_MIN_DIM {min_dim}"
    if layers == "mlp" and not name.endswith(MLP_LAYERS):
        return "not a block's feed-forward matrix (AMP.FLOAT8_LAYERS mlp)"
    if layers == "auto":
        after_attention = name.endswith(AFTER_ATTENTION)
        if rows <= 0 or float8_gain(*sides, rows, after_attention) <= 0:
            return f"casts outweigh the float8 matmul at {rows} rows (AMP.FLOAT8_LAYERS auto)"
    return ""


def eligible(module, name, min_dim, layers="all", rows=0):
    """Whether the layer ``name`` (a ``module`` of the model) is converted (see ``why_kept``)."""
    return not why_kept(module, name, min_dim, layers, rows)


def _torchao():
    try:
        import torchao.float8  # optional: only AMP.FLOAT8 needs torchao
    except ImportError:
        raise ImportError(
            "AMP.FLOAT8 needs the torchao package: pip install torchao (or pycls-vit[float8])"
        ) from None
    return torchao.float8


def convert(model, recipe, min_dim, fsdp_all_gather=False, layers="all", rows=0):
    """Converts ``model``'s eligible linear layers to float8 in place (``recipe`` "tensorwise" or
    "rowwise"; ``fsdp_all_gather``: tensorwise weights all-gathered in float8 under FSDP2;
    ``layers`` and ``rows``: see ``why_kept``); returns the names of the converted layers, logged
    with those left as they were."""
    if recipe not in RECIPES:
        raise ValueError(f"AMP.FLOAT8 {recipe!r} is not one of {['none', *RECIPES]}")
    if layers not in LAYER_CHOICES:
        raise ValueError(f"AMP.FLOAT8_LAYERS {layers!r} is not one of {list(LAYER_CHOICES)}")
    f8 = _torchao()
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather and recipe == "tensorwise":  # rowwise scales cannot gather in float8
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = chosen_layers(model, min_dim, layers, rows)
    if chosen:
        f8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, n: n in chosen
        )
    kept = {n: why_kept(m, n, min_dim, layers, rows) for n, m in linears.items() if n not in chosen}
    _log(recipe, chosen, kept, linears)
    return chosen


def layer_rows(model, micro_batch):
    """The rows of input each linear layer of ``model`` sees in a micro-batch of ``micro_batch``
    images (its tokens per image, ``pycls.models.parallel_plans.tokens_per_image``): the ``rows``
    of ``why_kept``."""
    return micro_batch * tokens_per_image(model)


def chosen_layers(model, min_dim, layers="all", rows=0):
    """The names of ``model``'s linear layers that ``convert`` would convert (nothing changed)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return [n for n, m in linears.items() if eligible(m, n, min_dim, layers, rows)]


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


def _log(recipe, chosen, kept, linears):
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
            f"AMP.FLOAT8 {recipe} converts no layer of this model (each kept for the reason "
            f"above; AMP.FLOAT8_MIN_DIM 0 with AMP.FLOAT8_LAYERS all converts every layer whose "
            "sides are multiples of 16; docs/float8.md)"
        )


def precompute_scales(model):
    """The float8 scales of every FSDP2-sharded tensorwise weight for the next all-gather, in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); call after each
    optimizer step."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
