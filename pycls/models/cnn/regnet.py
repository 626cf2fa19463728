"""RegNet ("Designing Network Design Spaces", Radosavovic et al., 2020): an AnyNet whose
per-stage widths and depths come from a quantized linear rule of five numbers.

Block i of ``depth`` blocks would ideally have width ``w_0 + w_a * i``; each width is snapped to
``w_0 * w_m ** k`` for the nearest integer k (then to a multiple of 8), and consecutive blocks of
equal width form a stage. RegNetX is this with residual bottleneck blocks, RegNetY adds
squeeze-excitation.
"""

from pycls.models.cnn.anynet import AnyNet, adjust_block_compatibility, anynet_complexity
from pycls.models.cnn.cnn_args import quantized_widths


def regnet_to_anynet(
    *,
    w_a: float = 5.0,
    w_0: int = 32,
    w_m: float = 2.5,
    depth: int = 10,
    group_w: int = 16,
    bot_mul: float = 1.0,
    stride: int = 2,
    stem_type: str = "simple_stem_in",
    stem_w: int = 32,
    block_type: str = "res_bottleneck_block",
    head_w: int = 0,
    se_r: float = 0.0,
) -> dict:
    """The AnyNet arguments (stem, per-stage lists, head, SE) of a RegNet."""
    ws, ds = quantized_widths(w_a, w_0, w_m, depth)
    n = len(ws)
    ws, bs, gs = adjust_block_compatibility(ws, [bot_mul] * n, [group_w] * n)
    return dict(
        stem_type=stem_type,
        stem_w=stem_w,
        block_type=block_type,
        depths=tuple(ds),
        widths=tuple(ws),
        strides=(stride,) * n,
        bot_muls=tuple(bs),
        group_ws=tuple(gs),
        head_w=head_w,
        se_r=se_r,
    )


class RegNet(AnyNet):
    """An AnyNet built from RegNet's parameters (the same module names as AnyNet).

    Args (keyword-only): w_a (slope), w_0 (initial width, a multiple of 8), w_m (width
    multiplier between stages), depth (total blocks), group_w, bot_mul, stride (of every
    stage), stem_type, stem_w, block_type, head_w, se_r (0 = RegNetX, 0.25 = RegNetY), as in
    ``regnet_to_anynet``; num_classes, in_channels, the batch norm and activation arguments are
    AnyNet's. ``self.regnet`` keeps the RegNet parameters, ``self.arch`` the AnyNet ones.
    """

    def __init__(
        self,
        *,
        w_a: float = 5.0,
        w_0: int = 32,
        w_m: float = 2.5,
        depth: int = 10,
        group_w: int = 16,
        bot_mul: float = 1.0,
        stride: int = 2,
        stem_type: str = "simple_stem_in",
        stem_w: int = 32,
        block_type: str = "res_bottleneck_block",
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
        regnet = dict(w_a=w_a, w_0=w_0, w_m=w_m, depth=depth, group_w=group_w, bot_mul=bot_mul)
        regnet.update(stride=stride, stem_type=stem_type, stem_w=stem_w, block_type=block_type)
        regnet.update(head_w=head_w, se_r=se_r)
        super().__init__(
            **regnet_to_anynet(**regnet),
            num_classes=num_classes,
            in_channels=in_channels,
            bn_eps=bn_eps,
            bn_momentum=bn_momentum,
            zero_init_final_gamma=zero_init_final_gamma,
            activation=activation,
            activation_inplace=activation_inplace,
        )
        self.regnet = regnet


def regnet_complexity(*, image_size: int = 224, num_classes: int = 1000, in_channels=3, **regnet):
    """Complexity of ``RegNet(**the same arguments)``."""
    anynet = regnet_to_anynet(**regnet)
    return anynet_complexity(
        image_size=image_size, num_classes=num_classes, in_channels=in_channels, **anynet
    )
