"""The ViTs people start from today, as timm 1.0.31 defines them, in and out of pycls: each built by
``timm.create_model(name, pretrained=False)`` at a small depth, width and image size and random
weights (nothing is downloaded), then timm -> pycls gives timm's logits to 1e-4 in both token
layouts, and pycls -> timm -> pycls gives pycls's bitwise, the timm model built as the export
builds it (``convert.to_timm``: ``timm.create_model`` with the exported name and arguments). What
timm's Eva has and pycls cannot express is refused naming the option."""

import pytest
import torch
from torch import nn

from pycls.models import convert
from pycls.models.vit import from_timm

timm = pytest.importorskip("timm")

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

SMALL = dict(depth=2, embed_dim=32, num_heads=2, num_classes=5)
# Each family's reference (the table) and what each must exercise: the feature it needs
REFERENCES = {
    "deit3_small_patch16_224": dict(img_size=32),  # LayerScale, no_embed_class
    "vit_small_patch14_reg4_dinov2": dict(img_size=28),  # LayerScale, registers
    "vit_giant_patch14_dinov2": dict(img_size=28, embed_dim=48),  # packed SwiGLU
    "vit_small_patch16_dinov3": dict(img_size=32),  # DINOv3's RoPE, storage tokens, no pos
    "vit_base_patch16_siglip_224": dict(img_size=32),  # the attention pool (MAP)
    "eva02_tiny_patch14_224": dict(img_size=28),  # packed SwiGLU, EVA's RoPE, q and v biases
    "eva02_base_patch14_224": dict(img_size=28),  # SwiGLU with sub-LN, separate q, k, v
    "vit_small_patch16_rope_224": dict(img_size=32),  # axial RoPE ('xy'), full qkv bias
    "vit_small_patch16_rope_mixed_224": dict(img_size=32),  # mixed RoPE (learned frequencies)
    "vit_base_patch16_xp_224": dict(img_size=32),  # parallel blocks, RMSNorm, QK-norm
}
# What the pycls model of each must have: the features, checked so that a reader that dropped
# one (and a timm that happened to agree) cannot pass
FEATURES = {
    "deit3_small_patch16_224": dict(layer_scale_init=1e-6),
    "vit_small_patch14_reg4_dinov2": dict(layer_scale_init=1e-5, num_registers=4),
    "vit_giant_patch14_dinov2": dict(ffn="swiglu_packed", layer_scale_init=1e-5),
    "vit_small_patch16_dinov3": dict(rope="dinov3", rope_layout="half", num_registers=4,
                                     pos_embed="none", qkv_bias=False, norm_eps=1e-5),
    "vit_base_patch16_siglip_224": dict(classifier="map", class_token=False),
    "eva02_tiny_patch14_224": dict(ffn="swiglu_packed", rope="axial", rope_ref_grid=16,
                                   key_bias=False, classifier="pooled", fc_norm=True),
    "eva02_base_patch14_224": dict(ffn="swiglu", ffn_norm=True, key_bias=False),
    "vit_small_patch16_rope_224": dict(rope="axial", rope_grid_indexing="xy",
                                       rope_temperature=100.0, pos_embed="none"),
    "vit_small_patch16_rope_mixed_224": dict(rope="mixed", rope_grid_indexing="xy"),
    "vit_base_patch16_xp_224": dict(block="parallel", norm_layer="rms", qk_norm="rms",
                                    qkv_bias=False, pre_norm=True),
}  # fmt: skip


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial values everywhere: timm zero-initialises biases, heads and probes, and starts
    LayerScale at 1e-5, which would hide a branch from the logits."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            base = 1.0 if p.ndim == 1 and name in ("weight", "gamma") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    for name, p in model.named_parameters():
        if name.endswith(("gamma_1", "gamma_2")):  # Eva's LayerScale
            with torch.no_grad():
                p.add_(1.0)
    return model.eval()


def build(name):
    return randomize(timm.create_model(name, pretrained=False, **{**SMALL, **REFERENCES[name]}))


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", list(REFERENCES))
def test_timm_reference_in_and_out(name):
    """Catches a feature read wrong or dropped on the way in (the logits differ from timm's), a
    name or a tensor mapped wrong on the way out (timm's strict load fails, or the logits come
    back changed), and an export that picks a timm class or builder argument that builds
    another network."""
    timm_model = build(name)
    side = REFERENCES[name]["img_size"]
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = timm_model(x)
        for layout in ("batch_first", "batch_second"):
            model = from_timm(timm_model, layout=layout).eval()
            assert rel_err(model(x), expected) < 1e-4, layout
        for arg, value in FEATURES[name].items():
            assert getattr(model.args, arg) == value, arg
        again = convert.to_timm(model).eval()
        back = from_timm(again, layout="batch_second").eval()
        assert back.args == model.args
        assert torch.equal(back(x), model(x))
        assert rel_err(again(x), model(x)) < 1e-4


def test_the_reference_logits_depend_on_the_features():
    """The comparison can fail: DINOv3's model without its RoPE, the SigLIP model with a mean
    instead of its attention pool, give other logits than timm's."""
    for name, change in (("vit_small_patch16_dinov3", "rope"),
                         ("vit_base_patch16_siglip_224", "classifier")):  # fmt: skip
        timm_model = build(name)
        model = from_timm(timm_model)
        other = dict(model.arch, **{change: "none" if change == "rope" else "pooled"})
        changed = type(model)(**other)
        changed.load_state_dict(model.state_dict(), strict=False)
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            assert rel_err(changed.eval()(x), timm_model(x)) > 1e-3


EVA_REFUSED = [
    (dict(use_post_norm=True), "block_fn / use_post_norm"),
    (dict(scale_attn_inner=True), "scale_attn_norm / scale_attn_inner"),
    (dict(use_rot_pos_emb=True, rope_type="mrope"), "rope_type"),
    (dict(use_rot_pos_emb=True, rope_rescale_coords=2.0), "rope_shift_coords"),
    (dict(use_rot_pos_emb=True, rope_grid_offset=0.5), "rope_grid_offset"),
    (dict(init_values=1e-5, attn_only_layer_scale=True), "attn_only_layer_scale"),
    (dict(global_pool="avgmax"), "global_pool"),
    (dict(patch_drop_rate=0.25), "patch_drop_rate"),
    (dict(dynamic_img_size=True), "dynamic_img_size"),
    (dict(attn_type="rope", qkv_fused=False, num_kv_heads=1), "num_kv_heads"),
]


@pytest.mark.parametrize("kwargs, option", EVA_REFUSED, ids=[o for _, o in EVA_REFUSED])
def test_what_pycls_cannot_express_of_eva_is_refused_by_name(kwargs, option):
    from timm.models.eva import Eva

    model = Eva(img_size=32, patch_size=16, **SMALL, **kwargs)
    with pytest.raises(ValueError, match=f"timm option {option}"):
        from_timm(model)
