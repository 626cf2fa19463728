"""What the CNN families' arguments may be: AnyNet's stems, blocks and stages, RegNet's quantized
linear widths, ResNet's layouts and depths, EfficientNet's stages. Plain Python, no torch: the
families check their arguments with these, and so does the config when it loads (the model
modules: anynet, regnet, resnet, effnet)."""

import math

STEM_TYPES = ("res_stem_cifar", "res_stem_in", "simple_stem_in")
BLOCK_TYPES = (
    "vanilla_block",
    "res_basic_block",
    "res_bottleneck_block",
    "res_bottleneck_linear_block",
)
# Blocks that read bot_mul and group_w (the others ignore them)
BOTTLENECK_BLOCKS = ("res_bottleneck_block", "res_bottleneck_linear_block")

IMAGENET_STAGE_DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
TRANS_FUNS = ("basic_transform", "bottleneck_transform")
RESNET_LAYOUTS = ("imagenet", "cifar")


def _stage_lists(depths, widths, strides, bot_muls, group_ws):
    n = len(depths)
    bot_muls = list(bot_muls) if bot_muls else [1.0] * n
    group_ws = list(group_ws) if group_ws else [1] * n
    lists = (list(depths), list(widths), list(strides), bot_muls, group_ws)
    if any(len(v) != n for v in lists):
        names = "depths, widths, strides, bot_muls, group_ws"
        raise ValueError(f"AnyNet needs one value per stage in {names}; got {lists}")
    return list(zip(*lists))


def check_anynet_args(stem_type, block_type, depths, widths, strides, bot_muls, group_ws):
    if stem_type not in STEM_TYPES:
        raise ValueError(f"unknown stem_type {stem_type!r}; expected one of {sorted(STEM_TYPES)}")
    if block_type not in BLOCK_TYPES:
        raise ValueError(
            f"unknown block_type {block_type!r}; expected one of {sorted(BLOCK_TYPES)}"
        )
    if block_type in BOTTLENECK_BLOCKS and not (bot_muls and group_ws):
        raise ValueError(f"block_type {block_type!r} needs bot_muls and group_ws per stage")
    stages = _stage_lists(depths, widths, strides, bot_muls, group_ws)
    if not stages:
        raise ValueError("AnyNet needs at least one stage (depths, widths, strides)")
    for i, (d, w, s, b, g) in enumerate(stages):
        if d < 1 or w < 1 or s < 1:
            raise ValueError(f"stage {i + 1}: depth, width and stride must be >= 1, got {d, w, s}")
        if block_type in BOTTLENECK_BLOCKS:
            w_b = int(round(w * b))
            if g < 1 or w_b < 1 or w_b % g:
                raise ValueError(
                    f"stage {i + 1}: bottleneck width {w_b} (width {w} x bot_mul {b}) must be a "
                    f"positive multiple of the group width {g}"
                )
    return stages


def quantized_widths(w_a: float, w_0: int, w_m: float, depth: int, q: int = 8):
    """(stage widths, stage depths) of the quantized linear rule (widths ascending)."""
    if not (w_a >= 0 and w_0 > 0 and w_m > 1 and w_0 % q == 0 and depth >= 1):
        raise ValueError(
            f"RegNet needs w_a >= 0, w_0 > 0 a multiple of {q}, w_m > 1 and depth >= 1; got "
            f"w_a={w_a}, w_0={w_0}, w_m={w_m}, depth={depth}"
        )
    widths = []
    for i in range(depth):
        w_cont = i * w_a + w_0
        k = round(math.log(w_cont / w_0) / math.log(w_m))
        widths.append(round(w_0 * math.pow(w_m, k) / q) * q)
    stage_widths = sorted(set(widths))
    return stage_widths, [widths.count(w) for w in stage_widths]


def check_resnet_args(layout, depth, trans_fun):
    if layout not in RESNET_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {RESNET_LAYOUTS}")
    if trans_fun not in TRANS_FUNS:
        raise ValueError(f"unknown trans_fun {trans_fun!r}; expected one of {TRANS_FUNS}")
    if layout == "cifar":
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"a CIFAR ResNet's depth is 6n + 2 (20, 56, 110, ...), got {depth}")
        if trans_fun != "basic_transform":
            raise ValueError("the CIFAR ResNet uses trans_fun 'basic_transform'")
    else:
        if depth not in IMAGENET_STAGE_DEPTHS:
            raise ValueError(
                f"an ImageNet ResNet's depth is one of {sorted(IMAGENET_STAGE_DEPTHS)}, got {depth}"
            )
        if trans_fun != "bottleneck_transform":
            raise ValueError("the ImageNet ResNet uses trans_fun 'bottleneck_transform'")


def check_effnet_args(depths, widths, exp_ratios, strides, kernels):
    """The stages as (depth, width, exp_ratio, stride, kernel) tuples; ValueError if invalid."""
    lists = [list(v) for v in (depths, widths, exp_ratios, strides, kernels)]
    if not lists[0] or any(len(v) != len(lists[0]) for v in lists):
        raise ValueError(
            "EffNet needs one value per stage in depths, widths, exp_ratios, strides, kernels; "
            f"got {lists}"
        )
    stages = list(zip(*lists))
    for i, (d, w, exp_r, s, k) in enumerate(stages):
        if min(d, w, s) < 1 or exp_r <= 0 or k < 1 or k % 2 == 0:
            raise ValueError(
                f"stage {i + 1}: depth, width, stride >= 1, exp_ratio > 0 and an odd kernel "
                f"needed, got {d, w, exp_r, s, k}"
            )
    return stages
