"""ResNet and ResNeXt ("Deep residual learning", He et al.; "Aggregated residual
transformations", Xie et al.) in upstream pycls's ``MODEL.TYPE resnet`` form.

Two layouts, as upstream: "imagenet" (7x7 stem, four bottleneck stages of (3, 4, 6, 3),
(3, 4, 23, 3) or (3, 8, 36, 3) blocks for depth 50, 101, 152) and "cifar" (3x3 stem, three
basic stages of (depth - 2) / 6 blocks, widths 16, 32, 64). The published zoo's ResNet-50 and
ResNeXt models are AnyNets instead (``pycls.models.zoo``); this class serves the configs that
say ``MODEL.TYPE resnet``. Parameter names are upstream's (``s1.b1.f.a``, ``head.fc``, ...).
"""

from torch import nn

from pycls.models.cnn.anynet import BasicTransform, Residual, ResStemCifar, ResStemIN
from pycls.models.cnn.cnn_args import IMAGENET_STAGE_DEPTHS, check_resnet_args
from pycls.models.cnn.cnn_layers import (
    ConvNet,
    Cx,
    Head,
    LayerOptions,
    activation,
    conv2d,
    final_norm2d,
    norm2d,
)


class BottleneckTransform(nn.Module):
    """1x1, BN, act, grouped 3x3, BN, act, 1x1, BN; the stride on the first 1x1 conv
    (``stride_1x1``, MSRA's original) or on the 3x3 conv (fb.torch, torchvision)."""

    def __init__(self, w_in, w_out, stride, w_b, groups, stride_1x1, opts):
        super().__init__()
        s1, s3 = (stride, 1) if stride_1x1 else (1, stride)
        self.a = conv2d(w_in, w_b, 1, stride=s1)
        self.a_bn = norm2d(w_b, opts)
        self.a_af = activation(opts)
        self.b = conv2d(w_b, w_b, 3, stride=s3, groups=groups)
        self.b_bn = norm2d(w_b, opts)
        self.b_af = activation(opts)
        self.c = conv2d(w_b, w_out, 1)
        self.c_bn = final_norm2d(w_out, opts)

    def forward(self, x):
        x = self.a_af(self.a_bn(self.a(x)))
        x = self.b_af(self.b_bn(self.b(x)))
        return self.c_bn(self.c(x))

    @staticmethod
    def complexity(cx, w_in, w_out, stride, w_b, groups, stride_1x1):
        s1, s3 = (stride, 1) if stride_1x1 else (1, stride)
        cx.conv(w_in, w_b, 1, stride=s1).norm(w_b)
        cx.conv(w_b, w_b, 3, stride=s3, groups=groups).norm(w_b)
        return cx.conv(w_b, w_out, 1).norm(w_out)


class ResBlock(Residual):
    """x + f(x) with f the basic or the bottleneck transform (RESNET.TRANS_FUN)."""

    def __init__(self, w_in, w_out, stride, trans_fun, w_b, groups, stride_1x1, opts):
        if trans_fun == "basic_transform":
            f = BasicTransform(w_in, w_out, stride, opts)
        else:
            f = BottleneckTransform(w_in, w_out, stride, w_b, groups, stride_1x1, opts)
        super().__init__(w_in, w_out, stride, f, opts)

    @staticmethod
    def complexity(cx, w_in, w_out, stride, trans_fun, w_b, groups, stride_1x1):
        Residual.shortcut_complexity(cx, w_in, w_out, stride)
        if trans_fun == "basic_transform":
            return BasicTransform.complexity(cx, w_in, w_out, stride)
        return BottleneckTransform.complexity(cx, w_in, w_out, stride, w_b, groups, stride_1x1)


class ResStage(nn.Module):
    def __init__(self, w_in, w_out, stride, depth, trans_fun, w_b, groups, stride_1x1, opts):
        super().__init__()
        for i in range(depth):
            block = ResBlock(w_in, w_out, stride, trans_fun, w_b, groups, stride_1x1, opts)
            self.add_module(f"b{i + 1}", block)
            stride, w_in = 1, w_out

    def forward(self, x):
        for b in self.children():
            x = b(x)
        return x

    @staticmethod
    def complexity(cx, w_in, w_out, stride, depth, trans_fun, w_b, groups, stride_1x1):
        for _ in range(depth):
            ResBlock.complexity(cx, w_in, w_out, stride, trans_fun, w_b, groups, stride_1x1)
            stride, w_in = 1, w_out
        return cx


def resnet_stages(layout, depth, num_groups, width_per_group):
    """(stem width, [(w_in, w_out, stride, depth, w_b), ...]) of the layout."""
    if layout == "cifar":
        d = (depth - 2) // 6
        return 16, [(16, 16, 1, d, None), (16, 32, 2, d, None), (32, 64, 2, d, None)]
    w_b = num_groups * width_per_group
    widths = (64, 256, 512, 1024, 2048)
    stages = []
    for i, d in enumerate(IMAGENET_STAGE_DEPTHS[depth]):
        stages.append((widths[i], widths[i + 1], 1 if i == 0 else 2, d, w_b * 2**i))
    return 64, stages


def resnet_complexity(
    *,
    image_size: int = 224,
    depth: int = 50,
    layout: str = "imagenet",
    trans_fun: str = "bottleneck_transform",
    num_groups: int = 1,
    width_per_group: int = 64,
    stride_1x1: bool = True,
    num_classes: int = 1000,
    in_channels: int = 3,
) -> dict[str, int]:
    """Complexity of ``ResNet(**the same arguments)``."""
    check_resnet_args(layout, depth, trans_fun)
    stem_w, stages = resnet_stages(layout, depth, num_groups, width_per_group)
    stem = ResStemCifar if layout == "cifar" else ResStemIN
    cx = stem.complexity(Cx(image_size, image_size), in_channels, stem_w)
    for w_in, w_out, s, d, w_b in stages:
        ResStage.complexity(cx, w_in, w_out, s, d, trans_fun, w_b, num_groups, stride_1x1)
    return Head.complexity(cx, stages[-1][1], 0, num_classes).totals()


class ResNet(ConvNet):
    """Upstream pycls's ResNet / ResNeXt.

    Args (keyword-only): depth (50, 101, 152 for "imagenet"; 6n + 2 for "cifar"), layout,
    trans_fun ("bottleneck_transform" for imagenet, "basic_transform" for cifar), num_groups
    and width_per_group (the first stage's bottleneck is num_groups x width_per_group wide:
    1 x 64 is ResNet, 32 x 4 ResNeXt), stride_1x1 (stride on the first 1x1 conv instead of the
    3x3), num_classes, in_channels, and the batch norm / activation arguments of AnyNet.
    """

    count = staticmethod(resnet_complexity)

    def __init__(
        self,
        *,
        depth: int = 50,
        layout: str = "imagenet",
        trans_fun: str = "bottleneck_transform",
        num_groups: int = 1,
        width_per_group: int = 64,
        stride_1x1: bool = True,
        num_classes: int = 1000,
        in_channels: int = 3,
        bn_eps: float = 1e-5,
        bn_momentum: float = 0.1,
        zero_init_final_gamma: bool = False,
        activation: str = "relu",
        activation_inplace: bool = True,
    ):
        check_resnet_args(layout, depth, trans_fun)
        opts = LayerOptions(bn_eps, bn_momentum, activation, activation_inplace)
        arch = dict(
            depth=depth,
            layout=layout,
            trans_fun=trans_fun,
            num_groups=num_groups,
            width_per_group=width_per_group,
            stride_1x1=stride_1x1,
            num_classes=num_classes,
            in_channels=in_channels,
        )
        stem_w, stages = resnet_stages(layout, depth, num_groups, width_per_group)
        stem = (ResStemCifar if layout == "cifar" else ResStemIN)(in_channels, stem_w, opts)
        g = num_groups
        body = [
            ResStage(w_in, w_out, s, d, trans_fun, w_b, g, stride_1x1, opts)
            for w_in, w_out, s, d, w_b in stages
        ]
        head = Head(stages[-1][1], 0, num_classes, opts)
        super().__init__(stem, body, head, arch=arch, zero_init_final_gamma=zero_init_final_gamma)
