"""EfficientNet ("EfficientNet: rethinking model scaling", Tan and Le, 2019) as upstream pycls
builds it: a 3x3 stem, stages of mobile inverted bottlenecks (MBConv: 1x1 expansion, k x k
depthwise conv, squeeze-excitation, linear 1x1 projection, skip with drop connect) and a
1x1 conv head. Parameter names are upstream's (``s1.b1.dwise``, ``head.conv_bn``, ...).
"""

from torch import nn

from pycls.models.cnn.anynet import SimpleStemIN
from pycls.models.cnn.cnn_args import check_effnet_args
from pycls.models.cnn.cnn_layers import (
    SE,
    ConvNet,
    Cx,
    Head,
    LayerOptions,
    activation,
    conv2d,
    drop_connect,
    norm2d,
)


def mbconv_widths(w_in: int, exp_r: float, se_r: float) -> tuple[int, int]:
    """(expanded width, SE width); the SE width is a fraction of the block's input width."""
    return int(w_in * exp_r), int(w_in * se_r)


class MBConv(nn.Module):
    """Mobile inverted bottleneck with SE; the skip (and drop connect) when the shape is kept."""

    def __init__(self, w_in, exp_r, k, stride, se_r, w_out, dc_ratio, opts):
        super().__init__()
        w_exp, w_se = mbconv_widths(w_in, exp_r, se_r)
        self.exp = None
        if w_exp != w_in:
            self.exp = conv2d(w_in, w_exp, 1)
            self.exp_bn = norm2d(w_exp, opts)
            self.exp_af = activation(opts)
        self.dwise = conv2d(w_exp, w_exp, k, stride=stride, groups=w_exp)
        self.dwise_bn = norm2d(w_exp, opts)
        self.dwise_af = activation(opts)
        self.se = SE(w_exp, w_se, opts) if w_se else None
        self.lin_proj = conv2d(w_exp, w_out, 1)
        self.lin_proj_bn = norm2d(w_out, opts)
        self.has_skip = stride == 1 and w_in == w_out
        self.dc_ratio = dc_ratio

    def forward(self, x):
        f_x = self.exp_af(self.exp_bn(self.exp(x))) if self.exp is not None else x
        f_x = self.dwise_af(self.dwise_bn(self.dwise(f_x)))
        if self.se is not None:
            f_x = self.se(f_x)
        f_x = self.lin_proj_bn(self.lin_proj(f_x))
        if not self.has_skip:
            return f_x
        if self.training and self.dc_ratio > 0.0:
            f_x = drop_connect(f_x, self.dc_ratio)
        return x + f_x

    @staticmethod
    def complexity(cx, w_in, exp_r, k, stride, se_r, w_out):
        w_exp, w_se = mbconv_widths(w_in, exp_r, se_r)
        if w_exp != w_in:
            cx.conv(w_in, w_exp, 1).norm(w_exp)
        cx.conv(w_exp, w_exp, k, stride=stride, groups=w_exp).norm(w_exp)
        if w_se:
            cx.se(w_exp, w_se)
        return cx.conv(w_exp, w_out, 1).norm(w_out)


class EffStage(nn.Module):
    def __init__(self, w_in, exp_r, k, stride, se_r, w_out, depth, dc_ratio, opts):
        super().__init__()
        for i in range(depth):
            self.add_module(
                f"b{i + 1}", MBConv(w_in, exp_r, k, stride, se_r, w_out, dc_ratio, opts)
            )
            stride, w_in = 1, w_out

    def forward(self, x):
        for b in self.children():
            x = b(x)
        return x


def effnet_complexity(
    *,
    image_size: int = 224,
    stem_w: int = 32,
    depths=(),
    widths=(),
    exp_ratios=(),
    strides=(),
    kernels=(),
    se_r: float = 0.25,
    head_w: int = 1280,
    num_classes: int = 1000,
    in_channels: int = 3,
) -> dict[str, int]:
    """Complexity of ``EffNet(**the same arguments)``."""
    stages = check_effnet_args(depths, widths, exp_ratios, strides, kernels)
    cx = SimpleStemIN.complexity(Cx(image_size, image_size), in_channels, stem_w)
    w_in = stem_w
    for d, w, exp_r, s, k in stages:
        for _ in range(d):
            MBConv.complexity(cx, w_in, exp_r, k, s, se_r, w)
            s, w_in = 1, w
    return Head.complexity(cx, w_in, head_w, num_classes).totals()


class EffNet(ConvNet):
    """Upstream pycls's EfficientNet.

    Args (keyword-only): stem_w; per stage depths, widths, exp_ratios, strides, kernels; se_r
    (SE width as a fraction of each block's input width); head_w; dc_ratio (drop-connect rate
    of the skip blocks while training); dropout_ratio (before the classifier); num_classes,
    in_channels; batch norm and activation arguments as AnyNet's (EfficientNet uses "silu").
    """

    count = staticmethod(effnet_complexity)

    def __init__(
        self,
        *,
        stem_w: int = 32,
        depths: tuple[int, ...] = (),
        widths: tuple[int, ...] = (),
        exp_ratios: tuple[float, ...] = (),
        strides: tuple[int, ...] = (),
        kernels: tuple[int, ...] = (),
        se_r: float = 0.25,
        head_w: int = 1280,
        dc_ratio: float = 0.0,
        dropout_ratio: float = 0.0,
        num_classes: int = 1000,
        in_channels: int = 3,
        bn_eps: float = 1e-5,
        bn_momentum: float = 0.1,
        zero_init_final_gamma: bool = False,
        activation: str = "silu",
        activation_inplace: bool = True,
    ):
        stages = check_effnet_args(depths, widths, exp_ratios, strides, kernels)
        opts = LayerOptions(bn_eps, bn_momentum, activation, activation_inplace)
        arch = dict(
            stem_w=stem_w,
            depths=tuple(depths),
            widths=tuple(widths),
            exp_ratios=tuple(exp_ratios),
            strides=tuple(strides),
            kernels=tuple(kernels),
            se_r=se_r,
            head_w=head_w,
            num_classes=num_classes,
            in_channels=in_channels,
        )
        stem = SimpleStemIN(in_channels, stem_w, opts)
        w_in, body = stem_w, []
        for d, w, exp_r, s, k in stages:
            body.append(EffStage(w_in, exp_r, k, s, se_r, w, d, dc_ratio, opts))
            w_in = w
        head = Head(
            w_in, head_w, num_classes, opts, dropout_ratio=dropout_ratio, norm_name="conv_bn"
        )
        # (MBConv has no final_bn: zero_init_final_gamma changes nothing here, as upstream)
        super().__init__(stem, body, head, arch=arch, zero_init_final_gamma=zero_init_final_gamma)
