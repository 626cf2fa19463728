"""Model scaling from "Fast and Accurate Model Scaling" (Dollar, Singh, Girshick, 2021).

Plain arithmetic on the sizes of the CNN families (per-stage depths and widths, group widths,
image size), the same as upstream pycls's ``models/scaler.py``: scaling by s multiplies FLOPs by
about s, spread over depth (d), width (w), group width (g) and resolution (r) by the weights of a
scaling type such as "d1_w8_g8_r1" (fast compound scaling) or "dw" (= "d1_w1_g0_r0").
``pycls.core.scale_config`` applies it to a config.
"""

from pycls.models.cnn.anynet import adjust_block_compatibility


def scaling_factors(scale_type: str, factor: float) -> tuple[float, float, float, float]:
    """(d, w, g, r): the multipliers of depth, width, group width and resolution.

    FLOPs grow as d * w^2 * r^2, so d = s^(wd / S), w = s^(ww / 2S), r = s^(wr / 2S) with S the
    sum of the d, w, r weights; g, which adds no FLOPs of its own, follows s^(wg / 2S).
    """
    if scale_type and all(ch in "dwgr" for ch in scale_type):
        weights = {ch: float(ch in scale_type) for ch in "dwgr"}
    else:
        weights = dict.fromkeys("dwgr", 0.0)
        for part in scale_type.split("_"):
            if not part or part[0] not in "dwgr":
                raise ValueError(f"scaling type {scale_type!r}: {part!r} is not d, w, g or r")
            try:
                weights[part[0]] = float(part[1:])
            except ValueError:
                raise ValueError(f"scaling type {scale_type!r}: {part!r} has no weight") from None
    total = weights["d"] + weights["w"] + weights["r"] or weights["g"] / 2 or 1.0
    d = factor ** (weights["d"] / total)
    w, g, r = (factor ** (weights[ch] / total / 2.0) for ch in "wgr")
    return d, w, g, r


def _round8(x: float) -> int:
    return max(1, round(x / 8)) * 8


def scale_stages(depths, widths, bot_muls, group_ws, d, w, g):
    """AnyNet's per-stage lists scaled by (d, w, g); group widths snap to 1, 2, 4 or 8k."""
    bot_muls = list(bot_muls) or [1.0] * len(depths)
    group_ws = list(group_ws) or [1] * len(depths)
    depths = [max(1, round(x * d)) for x in depths]
    widths = [_round8(x * w) for x in widths]
    group_ws = [max(1, round(x * g)) for x in group_ws]
    group_ws = [x if x <= 2 else 4 if x <= 5 else round(x / 8) * 8 for x in group_ws]
    widths, bot_muls, group_ws = adjust_block_compatibility(widths, bot_muls, group_ws)
    return depths, widths, bot_muls, group_ws


def scale_image_size(size: int, r: float) -> int:
    """The image size scaled by r, a multiple of 4."""
    return round(size * r / 4) * 4


def scale_effnet(stem_w, depths, widths, exp_ratios, head_w, d, w):
    """EfficientNet's stem width, per-stage depths, widths and expansion ratios, and head width
    scaled by (d, w) as upstream does (widths a multiple of 8, compatible with the ratios)."""
    depths = [max(1, round(x * d)) for x in depths]
    widths = [_round8(x * w) for x in widths]
    widths, exp_ratios, _ = adjust_block_compatibility(widths, exp_ratios, [1] * len(widths))
    return _round8(stem_w * w), depths, widths, exp_ratios, _round8(head_w * w)
