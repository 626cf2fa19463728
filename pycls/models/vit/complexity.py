"""Analytic complexity of a VisionTransformer: FLOPs, parameters and activations per image.

Derived from the model's own argument record (``VitArgs``: the model calls
``vit_complexity(self.args)``), so the two cannot drift apart silently; tests check the result
against the built model and against ``torch.utils.flop_counter.FlopCounterMode``. Plain Python,
no torch.
"""

from pycls.models.vit.args import UNCOUNTED, VitArgs, keyword_signature

__all__ = ["UNCOUNTED", "encoder_block_flops", "vit_complexity", "vit_run_flops"]


def _conv_stem_counts(
    *,
    image_size: int,
    in_channels: int,
    width: int,
    channels: tuple[int, ...],
    kernels: tuple[int, ...],
    strides: tuple[int, ...],
) -> tuple[int, int, int]:
    """(flops, params, acts) of the conv stem; odd kernels map a side H to ceil(H / stride)."""
    flops = params = acts = 0
    side, c_in = image_size, in_channels
    for c_out, k, s in zip(channels, kernels, strides):
        side = -(-side // s)
        flops += k * k * c_in * c_out * side * side
        params += k * k * c_in * c_out + 2 * c_out  # conv without bias, BN weight and bias
        acts += c_out * side * side
        c_in = c_out
    flops += c_in * width * side * side  # final 1x1 conv
    params += c_in * width + width
    acts += width * side * side
    return flops, params, acts


def encoder_block_flops(length: int, width: int, mlp_dim: int, ffn: str = "mlp") -> int:
    """Multiply-adds of one encoder block over a sequence of ``length`` tokens: qkv and output
    projections, Q K^T and A V, and the feed-forward's layers (``mlp_dim`` its hidden width; a
    SwiGLU has two input projections of it, a parallel block the same products fused)."""
    d, m = width, mlp_dim
    ffn_products = 3 if ffn.startswith("swiglu") else 2
    return 4 * length * d * d + 2 * length * length * d + ffn_products * length * d * m


def _norm_params(a, width: int) -> int:
    """A norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
    return width * (2 if a.norm_layer == "layer" else 1)


def _block_params(a) -> int:
    """Parameters of one block (sequential or parallel) of the ViT of arguments ``a``."""
    d, h, bias = a.width, a.ffn_hidden, int(a.proj_bias)
    params = 3 * d * d + d * d + d * bias  # qkv and the attention's output projection
    params += 2 * _norm_params(a, d // a.num_heads) if a.qk_norm != "none" else 0
    params += d if a.rope == "mixed" else 0  # two frequencies per pair of each head's channels
    if a.block == "parallel":
        params += _norm_params(a, d) + 2 * d * h + (3 * d + h) * a.qkv_bias
        params += h if bias and not a.qkv_bias else 0  # the MLP's own bias
        return params + (d if a.layer_scale_init else 0)
    params += 2 * _norm_params(a, d) + (2 * d if a.layer_scale_init else 0)
    params += 3 * d * a.qkv_bias if a.key_bias else 2 * d * a.qkv_bias  # q_bias, v_bias
    inputs = 2 if a.ffn.startswith("swiglu") else 1
    params += inputs * (d * h + h * bias) + h * d + d * bias
    params += _norm_params(a, h) if a.ffn_norm else 0
    return params + (10 * h if a.ffn == "local" else 0)  # depthwise 3x3 weight and bias


def _block_acts(a, length: int) -> int:
    """Activations of one block: the linear layers' outputs, the attention matrices and the
    attention's output before its projection."""
    d, h = a.width, a.ffn_hidden
    inputs = 2 if a.ffn.startswith("swiglu") else 1
    acts = 3 * length * d + a.num_heads * length * length + 2 * length * d
    # the feed-forward's input and output projections; the parallel block's one output
    # projection serves both branches
    acts += inputs * length * h + (length * d if a.block == "sequential" else 0)
    return acts + (h * (length - a.num_prefix_tokens) if a.ffn == "local" else 0)


def _map_head(a, length: int) -> tuple[int, int, int]:
    """(flops, params, acts) of the attention pool ("map"): the probe's query, keys and values
    of every token, one query's attention, the projection and the MLP."""
    d, m = a.width, a.mlp_dim
    flops = d * d + 2 * d * d * length + 2 * length * d + d * d + 2 * d * m
    params = d + 4 * (d * d + d) + _norm_params(a, d) + d * m + m + m * d + d
    acts = d + 2 * d * length + a.num_heads * length + d + d + m + d
    return flops, params, acts


def vit_complexity(args: VitArgs | None = None, /, **kwargs) -> dict[str, int]:
    """Per-image complexity of the VisionTransformer built with these arguments.

    Takes the model's argument record (``model.args``, a ``VitArgs``) and any of its fields as
    keyword arguments over it, or the fields alone (``vit_complexity(**model.arch)``); those that
    do not change the count (``UNCOUNTED``: layout, dropout rates, drop path, norm eps,
    checkpointing, fc_norm, head init, the RoPE's frequencies) are accepted and ignored, any
    other name is an error.

    Returns ``dict(flops=..., params=..., acts=...)``:

    - ``flops``: multiply-adds, counted as pycls and timm do: every convolution and linear
      layer (bias additions not counted) plus the two attention matmuls, Q K^T and A V
      (each ``L * L * width`` per block; the attention pool's one query ``L * width``). Norms,
      activations, the SwiGLU's gate product, softmax, the RoPE's rotation, LayerScale,
      residual and position embedding additions, and the mean pooling are not counted. With
      the token classifier or the attention pool the head sees a single vector (two heads see
      one token each with the distillation token; none with ``num_classes`` 0).
      ``FlopCounterMode`` reports exactly twice this number.
    - ``params``: the exact number of trainable parameters, ``sum(p.numel())`` of the model
      (the sin-cos position table is a buffer, and BatchNorm running statistics are buffers).
    - ``acts``: the number of output elements of every convolution and linear layer (stem
      convs, qkv, attention proj, FFN layers including the depthwise conv, the attention pool's,
      pre-logits, head) plus, per block, the attention matrices (``num_heads * L * L``) and the
      attention output before ``proj`` (``L * width``; the attention pool's alike). Norm,
      activation and dropout outputs are not counted.
    """
    a = VitArgs.of(args, **kwargs)
    image_size, patch_size, in_channels, width = a.image_size, a.patch_size, a.in_channels, a.width
    grid = image_size // patch_size
    num_patches = grid * grid
    prefix = a.num_prefix_tokens
    length = num_patches + prefix
    d = width

    if a.stem == "conv":
        flops, params, acts = _conv_stem_counts(
            image_size=image_size,
            in_channels=in_channels,
            width=width,
            channels=a.conv_stem_channels,
            kernels=a.conv_stem_kernels,
            strides=a.conv_stem_strides,
        )
    else:
        flops = in_channels * patch_size * patch_size * d * num_patches
        params = in_channels * patch_size * patch_size * d + (0 if a.pre_norm else d)
        acts = d * num_patches
    params += prefix * d  # class token, distillation token and registers
    params += _norm_params(a, d) if a.pre_norm else 0
    params += length * d if a.pos_embed == "learned" else 0

    block_flops = encoder_block_flops(length, d, a.ffn_hidden, a.ffn)
    if a.ffn == "local":
        block_flops += 9 * a.ffn_hidden * num_patches  # depthwise 3x3 conv over patch tokens
    flops += a.depth * block_flops
    params += a.depth * _block_params(a)
    acts += a.depth * _block_acts(a, length)

    params += _norm_params(a, d)  # final norm (before pooling, or after it: fc_norm)
    if a.classifier == "map":
        flops, params, acts = (x + y for x, y in zip((flops, params, acts), _map_head(a, length)))
    head_in = d
    size = a.representation_size
    if size is not None:
        flops += d * size
        params += d * size + size
        acts += size
        head_in = size
    heads = 1 + int(a.dist_token)  # the distillation token has a head of its own
    flops += heads * head_in * a.num_classes
    params += heads * (head_in * a.num_classes + a.num_classes)
    acts += heads * a.num_classes
    return {"flops": flops, "params": params, "acts": acts}


# The arguments as help() shows them: the fields of VitArgs
vit_complexity.__signature__ = keyword_signature()


def vit_run_flops(
    arch: dict, *, stem_patches: int, sequence_lengths, images: int, block_fractions=None
) -> float:
    """Multiply-adds of one forward pass of the VisionTransformer built with ``arch`` (its
    ``model.arch``; not the local feed-forward) that embeds ``stem_patches`` patches, runs its
    blocks over sequences of ``sequence_lengths`` tokens (padding and prefix tokens included) and
    classifies ``images`` images: what patch dropout and token batches (padded or packed) cost,
    counted as ``vit_complexity`` counts (an attention pool's keys and values of every position
    of the sequences). A conv stem is counted per image at ``arch``'s size.
    ``block_fractions``: per block, the fraction of the sequences its branches run on
    (compute-skipping stochastic depth; default: all). With ``stem_patches`` the grid, one
    sequence of the whole grid and one image, it is ``vit_complexity(**arch)["flops"]``."""
    a = VitArgs.of(arch)
    if a.ffn == "local":
        raise ValueError("vit_run_flops counts the 'mlp' and SwiGLU feed-forwards only")
    full = vit_complexity(a)["flops"]
    d, p, depth = a.width, a.patch_size, a.depth
    grid_patches = (a.image_size // p) ** 2
    prefix = a.num_prefix_tokens
    per_patch = a.in_channels * p * p * d
    if a.stem == "conv":
        stem_full = _conv_stem_counts(
            image_size=a.image_size,
            in_channels=a.in_channels,
            width=d,
            channels=a.conv_stem_channels,
            kernels=a.conv_stem_kernels,
            strides=a.conv_stem_strides,
        )[0]
        stem = stem_full * images
    else:
        stem_full, stem = per_patch * grid_patches, per_patch * stem_patches
    blocks_full = depth * encoder_block_flops(prefix + grid_patches, d, a.ffn_hidden, a.ffn)
    head = full - stem_full - blocks_full
    pooled = 0  # an attention pool's keys, values and attention: per position of the sequences
    if a.classifier == "map":
        per_token = 2 * d * d + 2 * d
        head -= per_token * (prefix + grid_patches)
        pooled = per_token * sum(sequence_lengths)
    per_block = sum(encoder_block_flops(n, d, a.ffn_hidden, a.ffn) for n in sequence_lengths)
    fractions = [1] * depth if block_fractions is None else list(block_fractions)
    if len(fractions) != depth:
        raise ValueError(f"{len(fractions)} block fractions for {depth} blocks")
    blocks = per_block * depth if block_fractions is None else per_block * sum(fractions)
    return stem + blocks + head * images + pooled
