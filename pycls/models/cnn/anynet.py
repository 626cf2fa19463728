"""AnyNet ("Designing Network Design Spaces", Radosavovic et al., 2020): stem, stages, head.

A network is a stem, a list of stages (each ``depth`` blocks of one ``width``, the first block
taking the stage's ``stride``) and a head. The stem types, block types and their parameter names
are upstream pycls's, so upstream checkpoints load with ``strict=True``: ``stem.conv``,
``s1.b1.f.a``, ``s1.b1.f.se.f_ex.0``, ``head.fc`` and so on.

Each stem, block and head has a ``complexity(cx, ...)`` taking the same arguments as its
constructor; ``anynet_complexity`` walks the same lists ``AnyNet`` does.
"""

import math

from torch import nn

from pycls.models.cnn.cnn_args import BLOCK_TYPES, STEM_TYPES, check_anynet_args
from pycls.models.cnn.cnn_layers import (
    SE,
    ConvNet,
    Cx,
    Head,
    LayerOptions,
    activation,
    conv2d,
    final_norm2d,
    norm2d,
)

# ---- stems ------------------------------------------------------------------------------------


class ResStemCifar(nn.Module):
    """ResNet stem for CIFAR: 3x3 conv, BN, activation (no downsampling)."""

    def __init__(self, w_in: int, w_out: int, opts: LayerOptions):
        super().__init__()
        self.conv = conv2d(w_in, w_out, 3)
        self.bn = norm2d(w_out, opts)
        self.af = activation(opts)

    def forward(self, x):
        return self.af(self.bn(self.conv(x)))

    @staticmethod
    def complexity(cx: Cx, w_in: int, w_out: int) -> Cx:
        return cx.conv(w_in, w_out, 3).norm(w_out)


class ResStemIN(nn.Module):
    """ResNet stem for ImageNet: 7x7 conv stride 2, BN, activation, 3x3 max-pool stride 2."""

    def __init__(self, w_in: int, w_out: int, opts: LayerOptions):
        super().__init__()
        self.conv = conv2d(w_in, w_out, 7, stride=2)
        self.bn = norm2d(w_out, opts)
        self.af = activation(opts)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x):
        return self.pool(self.af(self.bn(self.conv(x))))

    @staticmethod
    def complexity(cx: Cx, w_in: int, w_out: int) -> Cx:
        return cx.conv(w_in, w_out, 7, stride=2).norm(w_out).max_pool(w_out, 3, stride=2)


class SimpleStemIN(nn.Module):
    """Simple stem for ImageNet (RegNet's): 3x3 conv stride 2, BN, activation."""

    def __init__(self, w_in: int, w_out: int, opts: LayerOptions):
        super().__init__()
        self.conv = conv2d(w_in, w_out, 3, stride=2)
        self.bn = norm2d(w_out, opts)
        self.af = activation(opts)

    def forward(self, x):
        return self.af(self.bn(self.conv(x)))

    @staticmethod
    def complexity(cx: Cx, w_in: int, w_out: int) -> Cx:
        return cx.conv(w_in, w_out, 3, stride=2).norm(w_out)


STEMS = {"res_stem_cifar": ResStemCifar, "res_stem_in": ResStemIN, "simple_stem_in": SimpleStemIN}


# ---- blocks: (w_in, w_out, stride, bot_mul, group_w, se_r, opts) --------------------------------


class VanillaBlock(nn.Module):
    """[3x3 conv, BN, activation] x 2, no residual."""

    def __init__(self, w_in, w_out, stride, bot_mul, group_w, se_r, opts):
        super().__init__()
        self.a = conv2d(w_in, w_out, 3, stride=stride)
        self.a_bn = norm2d(w_out, opts)
        self.a_af = activation(opts)
        self.b = conv2d(w_out, w_out, 3)
        self.b_bn = norm2d(w_out, opts)
        self.b_af = activation(opts)

    def forward(self, x):
        x = self.a_af(self.a_bn(self.a(x)))
        return self.b_af(self.b_bn(self.b(x)))

    @staticmethod
    def complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r):
        return cx.conv(w_in, w_out, 3, stride=stride).norm(w_out).conv(w_out, w_out, 3).norm(w_out)


class BasicTransform(nn.Module):
    """3x3 conv, BN, activation, 3x3 conv, BN (the residual branch of a basic block)."""

    def __init__(self, w_in, w_out, stride, opts):
        super().__init__()
        self.a = conv2d(w_in, w_out, 3, stride=stride)
        self.a_bn = norm2d(w_out, opts)
        self.a_af = activation(opts)
        self.b = conv2d(w_out, w_out, 3)
        self.b_bn = final_norm2d(w_out, opts)

    def forward(self, x):
        return self.b_bn(self.b(self.a_af(self.a_bn(self.a(x)))))

    @staticmethod
    def complexity(cx, w_in, w_out, stride):
        return cx.conv(w_in, w_out, 3, stride=stride).norm(w_out).conv(w_out, w_out, 3).norm(w_out)


def _needs_projection(w_in: int, w_out: int, stride: int) -> bool:
    return w_in != w_out or stride != 1


class Residual(nn.Module):
    """x + f(x) for a transform ``f`` built by the subclass; a 1x1 projection + BN on the
    shortcut when the shape changes (upstream's names: proj, bn, f, af)."""

    def __init__(self, w_in, w_out, stride, transform, opts):
        super().__init__()
        self.proj, self.bn = None, None
        if _needs_projection(w_in, w_out, stride):
            self.proj = conv2d(w_in, w_out, 1, stride=stride)
            self.bn = norm2d(w_out, opts)
        self.f = transform
        self.af = activation(opts)

    def forward(self, x):
        shortcut = self.bn(self.proj(x)) if self.proj is not None else x
        return self.af(shortcut + self.f(x))

    @staticmethod
    def shortcut_complexity(cx, w_in, w_out, stride):
        if _needs_projection(w_in, w_out, stride):
            cx.shortcut(w_in, w_out, stride=stride)


class ResBasicBlock(Residual):
    """x + f(x) with f the basic transform."""

    def __init__(self, w_in, w_out, stride, bot_mul, group_w, se_r, opts):
        super().__init__(w_in, w_out, stride, BasicTransform(w_in, w_out, stride, opts), opts)

    @staticmethod
    def complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r):
        Residual.shortcut_complexity(cx, w_in, w_out, stride)
        return BasicTransform.complexity(cx, w_in, w_out, stride)


def bottleneck_widths(w_in, w_out, bot_mul, group_w, se_r) -> tuple[int, int, int]:
    """(bottleneck width, groups of the 3x3 conv, SE width; 0 = no SE). The SE width is a
    fraction of the block's input width, as in upstream."""
    w_b = int(round(w_out * bot_mul))
    return w_b, w_b // group_w, int(round(w_in * se_r))


class BottleneckTransform(nn.Module):
    """1x1 conv, BN, act, grouped 3x3 conv (the stride), BN, act, [SE], 1x1 conv, BN."""

    def __init__(self, w_in, w_out, stride, bot_mul, group_w, se_r, opts):
        super().__init__()
        w_b, groups, w_se = bottleneck_widths(w_in, w_out, bot_mul, group_w, se_r)
        self.a = conv2d(w_in, w_b, 1)
        self.a_bn = norm2d(w_b, opts)
        self.a_af = activation(opts)
        self.b = conv2d(w_b, w_b, 3, stride=stride, groups=groups)
        self.b_bn = norm2d(w_b, opts)
        self.b_af = activation(opts)
        self.se = SE(w_b, w_se, opts) if w_se else None
        self.c = conv2d(w_b, w_out, 1)
        self.c_bn = final_norm2d(w_out, opts)

    def forward(self, x):
        x = self.a_af(self.a_bn(self.a(x)))
        x = self.b_af(self.b_bn(self.b(x)))
        if self.se is not None:
            x = self.se(x)
        return self.c_bn(self.c(x))

    @staticmethod
    def complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r):
        w_b, groups, w_se = bottleneck_widths(w_in, w_out, bot_mul, group_w, se_r)
        cx.conv(w_in, w_b, 1).norm(w_b)
        cx.conv(w_b, w_b, 3, stride=stride, groups=groups).norm(w_b)
        if w_se:
            cx.se(w_b, w_se)
        return cx.conv(w_b, w_out, 1).norm(w_out)


class ResBottleneckBlock(Residual):
    """x + f(x) with f the bottleneck transform (ResNet, ResNeXt, RegNetX/Y)."""

    def __init__(self, w_in, w_out, stride, bot_mul, group_w, se_r, opts):
        f = BottleneckTransform(w_in, w_out, stride, bot_mul, group_w, se_r, opts)
        super().__init__(w_in, w_out, stride, f, opts)

    @staticmethod
    def complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r):
        Residual.shortcut_complexity(cx, w_in, w_out, stride)
        return BottleneckTransform.complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r)


class ResBottleneckLinearBlock(nn.Module):
    """x + f(x) with no activation after the sum, and no shortcut at all when the shape
    changes (the inverted-residual arrangement)."""

    def __init__(self, w_in, w_out, stride, bot_mul, group_w, se_r, opts):
        super().__init__()
        self.has_skip = not _needs_projection(w_in, w_out, stride)
        self.f = BottleneckTransform(w_in, w_out, stride, bot_mul, group_w, se_r, opts)

    def forward(self, x):
        return x + self.f(x) if self.has_skip else self.f(x)

    @staticmethod
    def complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r):
        return BottleneckTransform.complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r)


BLOCKS = {
    "vanilla_block": VanillaBlock,
    "res_basic_block": ResBasicBlock,
    "res_bottleneck_block": ResBottleneckBlock,
    "res_bottleneck_linear_block": ResBottleneckLinearBlock,
}
assert tuple(STEMS) == STEM_TYPES and tuple(BLOCKS) == BLOCK_TYPES  # the names cnn_args checks


# ---- stage, head, network -----------------------------------------------------------------------


class AnyStage(nn.Module):
    """``depth`` blocks named b1, b2, ...; the first takes the stride and the width change."""

    def __init__(self, w_in, w_out, stride, depth, block, bot_mul, group_w, se_r, opts):
        super().__init__()
        for i in range(depth):
            self.add_module(f"b{i + 1}", block(w_in, w_out, stride, bot_mul, group_w, se_r, opts))
            stride, w_in = 1, w_out

    def forward(self, x):
        for b in self.children():
            x = b(x)
        return x

    @staticmethod
    def complexity(cx, w_in, w_out, stride, depth, block, bot_mul, group_w, se_r):
        for _ in range(depth):
            block.complexity(cx, w_in, w_out, stride, bot_mul, group_w, se_r)
            stride, w_in = 1, w_out
        return cx


def anynet_complexity(
    *,
    image_size: int = 224,
    stem_type: str = "simple_stem_in",
    stem_w: int = 32,
    block_type: str = "res_bottleneck_block",
    depths=(),
    widths=(),
    strides=(),
    bot_muls=(),
    group_ws=(),
    head_w: int = 0,
    se_r: float = 0.0,
    num_classes: int = 1000,
    in_channels: int = 3,
) -> dict[str, int]:
    """Complexity of ``AnyNet(**the same arguments)`` on ``image_size`` square images."""
    stages = check_anynet_args(stem_type, block_type, depths, widths, strides, bot_muls, group_ws)
    cx = STEMS[stem_type].complexity(Cx(image_size, image_size), in_channels, stem_w)
    block, w_in = BLOCKS[block_type], stem_w
    for d, w, s, b, g in stages:
        AnyStage.complexity(cx, w_in, w, s, d, block, b, g, se_r)
        w_in = w
    return Head.complexity(cx, w_in, head_w, num_classes).totals()


class AnyNet(ConvNet):
    """Stem, stages s1..sN, head, with upstream pycls's names and initialisation.

    Args (keyword-only):
        stem_type: "res_stem_cifar" (3x3), "res_stem_in" (7x7/2 + max-pool/2) or
            "simple_stem_in" (3x3/2). stem_w: stem output width.
        block_type: "vanilla_block", "res_basic_block", "res_bottleneck_block" or
            "res_bottleneck_linear_block".
        depths, widths, strides: per stage, blocks, output width and the first block's stride.
        bot_muls, group_ws: per stage, bottleneck multiplier (bottleneck width = width x
            bot_mul) and group width of the 3x3 conv (bottleneck blocks only; empty = 1, 1).
        head_w: width of an extra 1x1 conv in the head (0 = none). se_r: squeeze-excitation
            ratio of the bottleneck blocks, relative to the block's input width (0 = no SE).
        num_classes, in_channels: classifier outputs, input channels.
        bn_eps, bn_momentum: batch norm epsilon and momentum (PyTorch convention).
        zero_init_final_gamma: start the last BN of each residual branch at zero.
        activation, activation_inplace: "relu", "silu"/"swish" or "gelu"; ReLU in place.
    """

    count = staticmethod(anynet_complexity)

    def __init__(
        self,
        *,
        stem_type: str = "simple_stem_in",
        stem_w: int = 32,
        block_type: str = "res_bottleneck_block",
        depths: tuple[int, ...] = (),
        widths: tuple[int, ...] = (),
        strides: tuple[int, ...] = (),
        bot_muls: tuple[float, ...] = (),
        group_ws: tuple[int, ...] = (),
        head_w: int = 0,
        se_r: float = 0.0,
        num_classes: int = 1000,
        in_channels: int = 3,
        bn_eps: float = 1e-5,
        bn_momentum: float = 0.1,
        zero_init_final_gamma: bool = False,
        activation: str = "relu",
        activation_inplace: bool = True,
    ):
        stages = check_anynet_args(
            stem_type, block_type, depths, widths, strides, bot_muls, group_ws
        )
        opts = LayerOptions(bn_eps, bn_momentum, activation, activation_inplace)
        arch = dict(
            stem_type=stem_type,
            stem_w=stem_w,
            block_type=block_type,
            depths=tuple(depths),
            widths=tuple(widths),
            strides=tuple(strides),
            bot_muls=tuple(bot_muls),
            group_ws=tuple(group_ws),
            head_w=head_w,
            se_r=se_r,
            num_classes=num_classes,
            in_channels=in_channels,
        )
        stem = STEMS[stem_type](in_channels, stem_w, opts)
        block, w_in, body = BLOCKS[block_type], stem_w, []
        for d, w, s, b, g in stages:
            body.append(AnyStage(w_in, w, s, d, block, b, g, se_r, opts))
            w_in = w
        head = Head(w_in, head_w, num_classes, opts)
        super().__init__(stem, body, head, arch=arch, zero_init_final_gamma=zero_init_final_gamma)


def adjust_block_compatibility(widths, bot_muls, group_ws):
    """Makes each stage's bottleneck width a multiple of its group width (and of an integer
    bottleneck multiplier), moving the widths as little as possible; returns the new
    (widths, bot_muls, group_ws). Upstream's rule, used by RegNet and by model scaling."""
    vs = [int(max(1, w * b)) for w, b in zip(widths, bot_muls)]
    gs = [int(min(g, v)) for g, v in zip(group_ws, vs)]
    ms = [math.lcm(g, int(b)) if b > 1 else g for g, b in zip(gs, bot_muls)]
    vs = [max(m, int(round(v / m) * m)) for v, m in zip(vs, ms)]
    ws = [int(v / b) for v, b in zip(vs, bot_muls)]
    return ws, list(bot_muls), gs
