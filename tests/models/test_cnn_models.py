"""The CNN families' switches: batch-norm arguments, zero-initialised final gammas, activations,
EfficientNet's drop connect and dropout, and the argument checks."""

import pytest
import torch
from torch import nn

from pycls.models import AnyNet, EffNet, RegNet, ResNet
from pycls.models.cnn.cnn_layers import drop_connect

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

TINY_EN = dict(
    stem_w=8,
    depths=(1, 2),
    widths=(8, 8),
    exp_ratios=(1, 4),
    strides=(1, 1),
    kernels=(3, 3),
    head_w=16,
    num_classes=5,
)


def test_batch_norm_arguments_reach_every_layer():
    model = RegNet(w_a=8.0, w_0=16, w_m=2.0, depth=3, group_w=8, bn_eps=1e-3, bn_momentum=0.01)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(bn.eps == 1e-3 and bn.momentum == 0.01 for bn in bns)


def test_zero_init_final_gamma_makes_residual_branches_start_at_zero():
    kw = dict(depth=50, num_groups=1, width_per_group=8, num_classes=3)
    zero, plain = ResNet(**kw, zero_init_final_gamma=True), ResNet(**kw)
    finals = [m for m in zero.modules() if getattr(m, "final_bn", False)]
    assert len(finals) == 16  # one per bottleneck block of ResNet-50
    assert all(torch.all(bn.weight == 0) for bn in finals)
    assert all(torch.all(m.weight == 1) for m in plain.modules() if getattr(m, "final_bn", False))
    # A block without projection is then the identity followed by ReLU
    block = zero.s1.b2.eval()
    x = torch.rand(1, 256, 8, 8)
    torch.testing.assert_close(block(x), torch.relu(x))


def test_activations():
    relu = AnyNet(stem_w=8, depths=(1,), widths=(8,), strides=(1,), bot_muls=(1,), group_ws=(8,))
    assert isinstance(relu.stem.af, nn.ReLU) and relu.stem.af.inplace
    silu = EffNet(**TINY_EN)  # EfficientNet's default, SE included
    assert isinstance(silu.stem.af, nn.SiLU) and isinstance(silu.s1.b1.se.f_ex[1], nn.SiLU)
    gelu = AnyNet(
        stem_w=8, depths=(1,), widths=(8,), strides=(1,), block_type="vanilla_block",
        activation="gelu",
    )  # fmt: skip
    assert isinstance(gelu.s1.b1.a_af, nn.GELU)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        AnyNet(stem_w=8, depths=(1,), widths=(8,), strides=(1,), bot_muls=(1,), group_ws=(8,),
               activation="tanh")  # fmt: skip


def test_drop_connect_and_dropout_act_in_training_only():
    model = EffNet(**TINY_EN, dc_ratio=0.5, dropout_ratio=0.5)
    x = torch.randn(4, 3, 16, 16)
    model.eval()
    with torch.no_grad():
        a, b = model(x), model(x)
    torch.testing.assert_close(a, b)
    # Training: drop connect only acts on blocks with a skip (s2.b2 here: stride 1, same width)
    assert not model.s1.b1.has_skip or model.s1.b1.dc_ratio == 0.5
    assert model.s2.b2.has_skip and model.head.dropout.p == 0.5
    model.train()
    torch.manual_seed(0)
    first = model(x)
    torch.manual_seed(1)
    assert not torch.allclose(first, model(x))
    # drop_connect: whole samples zeroed, survivors scaled by 1 / keep
    torch.manual_seed(0)
    y = drop_connect(torch.ones(1000, 2, 1, 1), 0.25)
    kept = y[:, 0, 0, 0]
    assert set(kept.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
    assert torch.all(y[:, 0] == y[:, 1])
    assert abs(kept.mean().item() - 1.0) < 0.1


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: AnyNet(depths=(1, 2), widths=(8,), strides=(1,), bot_muls=(1,), group_ws=(8,)),
         "one value per stage"),
        (lambda: AnyNet(depths=(1,), widths=(12,), strides=(1,), bot_muls=(1,), group_ws=(8,)),
         "multiple of the group width"),
        (lambda: AnyNet(depths=(1,), widths=(8,), strides=(1,)), "needs bot_muls and group_ws"),
        (lambda: AnyNet(stem_type="big", depths=(1,), widths=(8,), strides=(1,),
                        block_type="vanilla_block"), "unknown stem_type 'big'"),
        (lambda: RegNet(w_0=30), "multiple of 8"),
        (lambda: ResNet(depth=34), "50, 101, 152"),
        (lambda: ResNet(depth=20, layout="cifar"), "basic_transform"),
        (lambda: EffNet(**{**TINY_EN, "kernels": (3, 4)}), "odd kernel"),
    ],
)  # fmt: skip
def test_bad_arguments_raise_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build()
