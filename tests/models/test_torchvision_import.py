"""from_torchvision: converted models reproduce torchvision's logits in both layouts."""

import itertools
from functools import partial

import pytest
import torch
from torch import nn
from torchvision.models import vit_b_16
from torchvision.models.vision_transformer import ConvStemConfig
from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT

from pycls.models import VisionTransformer, from_torchvision

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


LAYOUTS = ["batch_first", "batch_second"]


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0, *, only_constant_init: bool = False) -> nn.Module:
    """Non-trivial weights everywhere: torchvision zero-inits the head, which would make any
    two models agree. ``only_constant_init`` leaves the randomly initialised matrices alone
    (enough for a big model, and much cheaper)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if only_constant_init and p.ndim > 1 and module is not model.heads.head:
                continue
            base = (
                1.0 if isinstance(module, nn.LayerNorm | nn.BatchNorm2d) and name == "weight" else 0
            )
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=gen))
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=gen))
            module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=gen))
    return model.eval()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def assert_same_logits(tv_model: nn.Module, image_size: int) -> None:
    x = torch.randn(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = tv_model(x)
        for layout in LAYOUTS:
            model = from_torchvision(tv_model, layout=layout)
            assert isinstance(model, VisionTransformer) and model.layout == layout
            assert not model.training
            tensors = itertools.chain(model.parameters(), model.buffers())
            assert not any(t.is_meta for t in tensors)
            assert rel_error(model(x), expected) <= 1e-4, layout


def small_tv(**overrides) -> TorchvisionViT:
    args = dict(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=10,
    )
    return randomize(TorchvisionViT(**{**args, **overrides}))


def test_vit_b_16_builder():
    assert_same_logits(randomize(vit_b_16(image_size=32), only_constant_init=True), 32)


def test_vit_b_32_like():
    assert_same_logits(small_tv(image_size=64, patch_size=32), 64)


def test_representation_size():
    tv_model = small_tv(representation_size=24)
    assert_same_logits(tv_model, 32)
    assert from_torchvision(tv_model).pre_logits[0].out_features == 24


def test_conv_stem():
    # Non-default BatchNorm eps must be carried over too.
    bn = partial(nn.BatchNorm2d, eps=1e-3)
    configs = [
        ConvStemConfig(out_channels=8, kernel_size=3, stride=2, norm_layer=bn),
        ConvStemConfig(out_channels=16, kernel_size=3, stride=2, norm_layer=bn),
        ConvStemConfig(out_channels=16, kernel_size=3, stride=2, norm_layer=bn),
    ]
    tv_model = small_tv(conv_stem_configs=configs)
    assert_same_logits(tv_model, 32)
    model = from_torchvision(tv_model)
    assert model.patch_embed.body[0].bn.eps == 1e-3
    assert model.arch["conv_stem_strides"] == (2, 2, 2)
    # the export names every tensor as torchvision does, conv stem and conv_last included
    from pycls.models.convert import pycls_to_torchvision

    exported = pycls_to_torchvision(model.state_dict())
    assert exported.keys() == tv_model.state_dict().keys()
    for key, value in tv_model.state_dict().items():
        assert torch.equal(exported[key], value), key


def test_vit_h_14_shape_maps_every_key():
    tv_model = randomize(
        TorchvisionViT(
            image_size=28, patch_size=14, num_layers=2, num_heads=16, hidden_dim=1280, mlp_dim=5120
        )
    )
    model = from_torchvision(tv_model)  # load_state_dict(strict=True) inside
    tv_state, state = tv_model.state_dict(), model.state_dict()
    assert len(state) == len(tv_state)
    assert sum(t.numel() for t in state.values()) == sum(t.numel() for t in tv_state.values())
    assert model.complexity()["params"] == sum(p.numel() for p in tv_model.parameters())
    torch.testing.assert_close(model.pos_embed, tv_model.encoder.pos_embedding, rtol=0, atol=0)
    assert_same_logits(tv_model, 28)


def test_sizes_dropout_and_mode_are_copied():
    tv_model = small_tv(dropout=0.1, attention_dropout=0.2).train()
    model = from_torchvision(tv_model)
    assert model.training
    assert model.blocks[0].attn.attn_dropout == 0.2
    assert model.pos_drop.p == 0.1 and model.blocks[1].ffn.drop1.p == 0.1
    assert (model.image_size, model.patch_size, len(model.blocks)) == (32, 8, 2)
    assert model.classifier == "token" and model.head.out_features == 10


def test_dtype_is_copied():
    tv_model = small_tv().to(torch.float64)
    model = from_torchvision(tv_model)
    assert model.head.weight.dtype == torch.float64
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        assert rel_error(model(x), tv_model(x)) <= 1e-12


def test_non_batchnorm_conv_stem_is_rejected():
    configs = [ConvStemConfig(out_channels=8, kernel_size=3, stride=8, norm_layer=nn.Identity)]
    with pytest.raises(ValueError, match="BatchNorm2d"):
        from_torchvision(small_tv(conv_stem_configs=configs))
