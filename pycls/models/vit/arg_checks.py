"""What must hold between the ViT's arguments (``VitArgs.check`` runs these after each field's
own values and bounds), each refusal a ``VitArgsError`` naming the argument it is about. Plain
Python, no torch: the config runs them too (``pycls.config.sections.model_vit``).
"""

import math

__all__ = ["VitArgsError", "check_between_fields", "check_image_size"]


class VitArgsError(ValueError):
    """An argument the ViT cannot be built with; ``arg`` names it."""

    def __init__(self, arg, message):
        super().__init__(message)
        self.arg = arg


def check_between_fields(a):
    """Raises VitArgsError unless the arguments ``a`` (a VitArgs) fit together."""
    for check in (_check_sizes, _check_rates, _check_tokens, _check_block, _check_rope):
        check(a)


def _check_sizes(a):
    check_image_size(a.image_size, a.patch_size)
    if a.width % a.num_heads != 0:
        raise VitArgsError("width", f"width {a.width} must be divisible by num_heads {a.num_heads}")
    if a.pos_embed == "sincos" and a.width % 4 != 0:
        raise VitArgsError(
            "pos_embed",
            f"pos_embed 'sincos' needs width divisible by 4, got width {a.width}",
        )
    if a.stem == "conv":
        _check_conv_stem(a)
    if a.checkpoint_blocks > a.depth:
        raise VitArgsError(
            "checkpoint_blocks",
            f"checkpoint_blocks must be in [0, depth={a.depth}], got {a.checkpoint_blocks}",
        )


def _check_conv_stem(a):
    channels, kernels, strides = (
        a.conv_stem_channels,
        a.conv_stem_kernels,
        a.conv_stem_strides,
    )
    if not channels or not len(channels) == len(kernels) == len(strides):
        raise VitArgsError(
            "conv_stem_channels",
            "stem 'conv' needs conv_stem_channels, conv_stem_kernels and conv_stem_strides of "
            f"the same non-zero length, got {channels}, {kernels}, {strides}",
        )
    if any(k % 2 == 0 or k <= 0 for k in kernels):
        # Odd kernels with padding (k - 1) // 2 are what keep the grid at image_size / patch
        raise VitArgsError("conv_stem_kernels", f"conv_stem_kernels must be odd, got {kernels}")
    if math.prod(strides) != a.patch_size:
        raise VitArgsError(
            "conv_stem_strides",
            f"product of conv_stem_strides {strides} is {math.prod(strides)}, "
            f"but must equal patch_size {a.patch_size}",
        )


def _check_rates(a):
    if a.patch_drop > 0 and a.ffn == "local":
        raise VitArgsError(
            "patch_drop",
            "patch_drop needs every patch of the grid with ffn 'local' (its convolution runs "
            "over the whole grid); use ffn 'mlp'",
        )


def _check_tokens(a):
    if a.dist_token and a.representation_size is not None:
        raise VitArgsError(
            "dist_token",
            "dist_token: DeiT's heads read the tokens, without representation_size",
        )
    if a.classifier == "token" and not a.class_token:
        raise VitArgsError("class_token", "classifier 'token' needs class_token=True (or None)")
    if a.dist_token and a.classifier == "map":
        raise VitArgsError("dist_token", "dist_token: DeiT's heads read the tokens, not an "
                               "attention pool (classifier 'map')")  # fmt: skip


def _check_block(a):
    if a.block == "parallel" and a.ffn != "mlp":
        raise VitArgsError("block", f"block 'parallel' fuses the attention's and a GELU MLP's "
                               f"projections: it needs ffn 'mlp', got {a.ffn!r}")  # fmt: skip
    if a.block == "parallel" and a.qkv_bias and not a.key_bias:
        raise VitArgsError("key_bias", "key_bias False: block 'parallel' has one input projection "
                           "whose bias covers the keys too")  # fmt: skip
    if a.ffn_norm and (a.ffn == "local" or a.block == "parallel"):
        what = "ffn 'local'" if a.ffn == "local" else "block 'parallel'"
        raise VitArgsError("ffn_norm", f"ffn_norm: {what} has no norm inside its MLP")


def _check_rope(a):
    if a.rope == "none":
        return
    head = a.width // a.num_heads
    if head % 4:
        raise VitArgsError("rope", f"rope {a.rope!r} turns pairs along two axes: it needs "
                               f"a head width divisible by 4, got {head}")  # fmt: skip
    if a.rope == "mixed" and a.rope_layout != "interleaved":
        raise VitArgsError("rope_layout", "rope 'mixed' turns interleaved pairs (RoPE-Mixed's "
                               "layout): rope_layout 'interleaved'")  # fmt: skip
    if a.rope_ref_grid and a.rope != "axial":
        raise VitArgsError("rope_ref_grid", f"rope_ref_grid scales the positions of rope "
                               f"'axial' only, not of {a.rope!r}")  # fmt: skip


def check_image_size(image_size: int, patch_size: int) -> None:
    if image_size <= 0 or image_size % patch_size != 0:
        raise VitArgsError(
            "image_size",
            f"image_size {image_size} must be a positive multiple of patch_size {patch_size}",
        )
