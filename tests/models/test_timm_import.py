"""from_timm: converted models reproduce timm's logits in both layouts; the rest is refused."""

from functools import partial

import pytest
import torch
from torch import nn

from pycls.models import convert
from pycls.models.vit import from_timm

timm_vit = pytest.importorskip("timm.models.vision_transformer")
SwiGLU, SwiGLUPacked = timm_vit.SwiGLU, timm_vit.SwiGLUPacked
ParallelScalingBlock = timm_vit.ParallelScalingBlock

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

LAYOUTS = ["batch_first", "batch_second"]
SMALL = dict(embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=7)

# Every variant claimed in from_timm's docstring
VARIANTS = {
    "token": dict(),
    "avg_fc_norm_cls": dict(global_pool="avg"),  # fc_norm on by default for avg (MAE/BEiT)
    "avg_no_fc_norm_no_cls": dict(global_pool="avg", fc_norm=False, class_token=False),
    "avg_fc_norm_no_cls": dict(global_pool="avg", class_token=False),
    "no_embed_class": dict(no_embed_class=True),  # DeiT III
    "pre_norm": dict(pre_norm=True),  # CLIP
    "no_qkv_bias": dict(qkv_bias=False),
    "registers_token": dict(reg_tokens=2),
    "registers_avg_no_embed_class": dict(reg_tokens=3, global_pool="avg", no_embed_class=True),
    "patch14": dict(patch_size=14, img_size=28),
    "patch32": dict(patch_size=32, img_size=64),
    "deeper_wider": dict(embed_dim=48, depth=3, num_heads=3, mlp_ratio=4.0),
    "layer_scale": dict(init_values=1e-5),
    "qk_norm": dict(qk_norm=True),
    "map": dict(global_pool="map", class_token=False),
    "no_pos_embed": dict(pos_embed="none"),
    "bias_free": dict(proj_bias=False, qkv_bias=False),
    "features_only": dict(num_classes=0),
    "rms_norm_swiglu_packed": dict(
        norm_layer="rmsnorm", mlp_layer=SwiGLUPacked, act_layer="silu"
    ),  # fmt: skip
    "swiglu_mlp_norm": dict(mlp_layer=SwiGLU, act_layer="silu", scale_mlp_norm=True),
    "parallel_fused_out": dict(block_fn=partial(ParallelScalingBlock, fuse_out_proj=True)),
}


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial values everywhere (timm zero-inits biases and near-zero-inits the token)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            base = 1.0 if isinstance(module, nn.LayerNorm) and name == "weight" else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def make_timm(**kwargs):
    args = {"img_size": 32, "patch_size": 16, **SMALL, **kwargs}
    return randomize(timm_vit.VisionTransformer(**args))


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_timm(name):
    timm_model = make_timm(**VARIANTS[name])
    side = timm_model.patch_embed.img_size[0]
    x = torch.randn(3, 3, side, side, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = timm_model(x)
        for layout in LAYOUTS:
            model = from_timm(timm_model, layout=layout).eval()
            assert rel_err(model(x), expected) < 1e-4, layout
    assert model.layout == "batch_second"
    assert not model.training


def test_converted_model_is_independent_and_trainable():
    timm_model = make_timm(global_pool="avg")
    model = from_timm(timm_model)
    assert all(p.device.type == "cpu" and p.requires_grad for p in model.parameters())
    before = timm_model.head.weight.clone()
    with torch.no_grad():
        model.head.weight.add_(1.0)
    assert torch.equal(timm_model.head.weight, before)  # no shared storage


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(scale_attn_norm=True), "scale_attn_norm"),
        (dict(global_pool="max"), "global_pool"),
        (dict(act_layer="gelu_tanh"), "act_layer"),
        (dict(drop_rate=0.1), "drop_rate"),
        (dict(dynamic_img_size=True), "dynamic_img_size"),
        (dict(final_norm=False), "final_norm"),
        (dict(pos_drop_rate=0.1), "pos_drop_rate"),
        (dict(patch_drop_rate=0.1), "patch_drop_rate"),
        (dict(block_fn=timm_vit.ParallelThingsBlock), "block_fn"),
        (dict(attn_layer="diff"), "attn_layer"),
        (dict(global_pool="avg", pool_include_prefix=True), "pool_include_prefix"),
        (dict(mlp_layer=SwiGLU), "act_layer"),  # a SwiGLU of GELU
        (dict(block_fn=ParallelScalingBlock, qkv_bias=False, proj_bias=False), "proj_bias=False"),
    ],
)
def test_unsupported_options_are_refused_by_name(kwargs, option):
    timm_model = timm_vit.VisionTransformer(img_size=32, patch_size=16, **{**SMALL, **kwargs})
    with pytest.raises(ValueError, match=f"timm option {option}"):
        from_timm(timm_model)


def test_not_a_timm_vit_is_refused():
    with pytest.raises(TypeError, match="timm VisionTransformer or Eva"):
        from_timm(nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["token", "avg_fc_norm_cls", "pre_norm", "registers_token",
                                  "layer_scale", "map", "swiglu_mlp_norm",
                                  "rms_norm_swiglu_packed"])  # fmt: skip
def test_round_trip_pycls_timm_pycls_is_exact(name):
    """pycls -> timm naming -> a timm model -> from_timm gives bitwise the same logits."""
    original = from_timm(make_timm(**VARIANTS[name]))
    timm_model = timm_vit.VisionTransformer(**convert.timm_kwargs(original)).eval()
    timm_model.load_state_dict(convert.from_pycls(original, "timm"), strict=True)
    back = from_timm(timm_model).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(x), original.eval()(x))
        assert rel_err(timm_model(x), original(x)) < 1e-4
