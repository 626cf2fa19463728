"""The ViT's block features (QK-norm, LayerScale, SwiGLU, RoPE, the attention pool, parallel
blocks, RMSNorm, bias-free projections, EVA's q and v biases) keep every way the model runs:
both token layouts, activation checkpointing, compute-skipping stochastic depth and the bfloat16
residual stream; the combinations that cannot work are refused in one line naming the argument
and the key; ``num_classes=0`` gives the pooled features (timm's). Each feature's numbers against
timm's own models: tests/models/test_timm_references.py and test_timm_import.py."""

import pytest
import torch

from pycls import config
from pycls.models import VisionTransformer
from pycls.models.vit.args import VitArgs, VitArgsError

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

SMALL = dict(image_size=16, patch_size=4, depth=2, width=32, num_heads=2, mlp_dim=64,
             num_classes=5, head_init_scale=1.0)  # fmt: skip
FEATURES = {
    "qk_norm layer": dict(qk_norm="layer"),
    "qk_norm rms, rms norms": dict(qk_norm="rms", norm_layer="rms"),
    "layer scale": dict(layer_scale_init=0.1),
    "swiglu": dict(ffn="swiglu", ffn_width="two_thirds", ffn_align=8),
    "swiglu packed, mlp norm": dict(ffn="swiglu_packed", ffn_norm=True),
    "rope axial": dict(rope="axial", pos_embed="none"),
    "rope mixed": dict(rope="mixed", num_registers=2),
    "rope dinov3": dict(rope="dinov3", rope_layout="half"),
    "attention pool": dict(classifier="map", class_token=False),
    "parallel": dict(block="parallel", qk_norm="layer", layer_scale_init=0.1, rope="axial"),
    "bias-free": dict(proj_bias=False, qkv_bias=False),
    "q and v biases": dict(key_bias=False),
}  # fmt: skip


def _model(name, **kwargs):
    torch.manual_seed(0)
    model = VisionTransformer(**{**SMALL, **FEATURES[name], **kwargs})
    with torch.no_grad():  # LayerScale, zero biases and probes would hide branches
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", list(FEATURES))
def test_both_layouts_give_the_same_logits(name):
    """Catches a feature that reads the sequence or batch dimension of one layout only (the
    rotation's positions, the attention pool's tokens, the parallel block's heads)."""
    first = _model(name).eval()
    second = _model(name, layout="batch_second").eval()
    second.load_state_dict(first.state_dict())
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(second(x), first(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(FEATURES))
def test_activation_checkpointing_gives_the_same_gradients(name):
    """The recomputed blocks (with dropout and drop path drawing again) give the same gradients:
    catches a block whose extra inputs (the rotation's positions) checkpointing drops."""
    regularised = dict(dropout=0.1, drop_path=0.2, attn_dropout=0.1)
    plain = _model(name, **regularised).train()
    ckpt = _model(name, **regularised, checkpoint_blocks=2).train()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, 16, 16)
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(0)
        model(x).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, grad in grads[0].items():
        torch.testing.assert_close(grads[1][n], grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_compute_skipping_drop_path_runs_the_kept_samples(name, layout, monkeypatch):
    """drop_path_mode skip with every sample kept (the draw fixed) is the plain model: catches a
    branch that loses its positions or its mask when cut to the kept samples."""
    plain = _model(name, layout=layout).train()
    skip = _model(name, layout=layout, drop_path=0.1, drop_path_mode="skip").train()
    skip.load_state_dict(plain.state_dict())
    # 4 samples at rate 0.1 keep int(3.6) = 3: keep the first three, scaled by 4/3
    monkeypatch.setattr(torch, "randperm", lambda n, device=None: torch.arange(n, device=device))
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        out = skip(x)
    assert torch.isfinite(out).all() and out.shape == (4, 5)
    with torch.no_grad():
        same = plain(x)
    assert not torch.allclose(out[3], same[3])  # the fourth sample lost its branches
    blocks = _model(name, layout=layout, depth=1).train()
    one = _model(name, layout=layout, depth=1, drop_path=0.5, drop_path_mode="skip").train()
    one.load_state_dict(blocks.state_dict())
    monkeypatch.setattr(torch, "randperm", lambda n, device=None: torch.arange(n, device=device))
    with torch.no_grad():  # one block (its rate is the last one's, 0.5): 2 of 4 kept, scale 2
        assert torch.isfinite(one(x)).all()


@pytest.mark.parametrize("name", list(FEATURES))
def test_the_bfloat16_residual_stream_stays_bfloat16(name):
    """Under autocast with residual_dtype bfloat16, every block receives and returns bfloat16
    (catches a feature's float32 parameter promoting the stream: LayerScale's gamma, a
    rotation's float32 angles, the MLP's bias of the parallel block), and the logits are the
    float32 stream's to bfloat16 rounding."""
    model = _model(name, residual_dtype="bfloat16").eval()
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    with torch.no_grad():
        want = model(x)
    assert ((logits.float() - want).abs().max() / want.abs().max()) < 0.1


@pytest.mark.parametrize(
    "kwargs, arg, message",
    [
        (dict(block="parallel", ffn="swiglu"), "block", "needs ffn 'mlp'"),
        (dict(block="parallel", ffn="local"), "block", "needs ffn 'mlp'"),
        (dict(block="parallel", ffn_norm=True), "ffn_norm", "block 'parallel'"),
        (dict(block="parallel", key_bias=False), "key_bias", "one input projection"),
        (dict(ffn="local", ffn_norm=True), "ffn_norm", "ffn 'local'"),
        (dict(rope="axial", width=36, num_heads=6), "rope", "head width divisible by 4"),
        (dict(rope="mixed", rope_layout="half"), "rope_layout", "interleaved"),
        (dict(rope="dinov3", rope_ref_grid=16), "rope_ref_grid", "'axial' only"),
        (dict(classifier="map", dist_token=True), "dist_token", "attention pool"),
        (dict(qk_norm="batch"), "qk_norm", "expected one of"),
        (dict(layer_scale_init=-1.0), "layer_scale_init", ">= 0"),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_argument(kwargs, arg, message):
    with pytest.raises(VitArgsError, match=message) as caught:
        VitArgs(**{**SMALL, **kwargs}).check()
    assert caught.value.arg == arg and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["VIT.BLOCK", "parallel", "VIT.FFN", "swiglu"], "VIT.BLOCK"),
        (["VIT.ROPE", "mixed", "VIT.ROPE_LAYOUT", "half"], "VIT.ROPE_LAYOUT"),
        (["VIT.QK_NORM", "batch"], "VIT.QK_NORM"),
    ],
)
def test_the_config_refuses_them_naming_the_key(overrides, key):
    with pytest.raises(config.ConfigError, match=rf"^{key}: ") as caught:
        config.load_cfg(None, ["MODEL.TYPE", "vit", *overrides])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("size", [None, 24])
@pytest.mark.parametrize("classifier", ["token", "pooled", "map"])
def test_num_classes_0_returns_the_pooled_features(classifier, size):
    """An identity head, as timm's: the model's output is what its head would see (the width, or
    representation_size), the complexity counts no head, and reset_classifier adds one."""
    kwargs = dict(SMALL, classifier=classifier, representation_size=size)
    with_head = VisionTransformer(**kwargs).eval()
    features = VisionTransformer(**{**kwargs, "num_classes": 0}).eval()
    assert isinstance(features.head, torch.nn.Identity) and features.num_classes == 0
    features.load_state_dict(with_head.state_dict(), strict=False)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = features(x)
        assert out.shape == (2, size or SMALL["width"])
        assert torch.equal(out, with_head.forward_head(with_head.forward_features(x),
                                                       pre_logits=True))  # fmt: skip
    cx, cx_head = features.complexity(), with_head.complexity()
    head_in = size or SMALL["width"]
    assert cx_head["params"] - cx["params"] == head_in * 5 + 5
    assert cx["params"] == sum(p.numel() for p in features.parameters())
    features.reset_classifier(3)
    assert features(x).shape == (2, 3)


def test_the_features_parameters_take_no_weight_decay():
    """LayerScale's scales, the queries' and keys' norms, the MLP's norm, a mixed RoPE's
    frequencies and the attention pool's probe are no weights to decay (timm excludes them)."""
    model = VisionTransformer(**SMALL, qk_norm="rms", layer_scale_init=0.1, ffn_norm=True,
                              rope="mixed", classifier="map")  # fmt: skip
    names = model.no_weight_decay_names()
    for name in ("blocks.0.ls_1.gamma", "blocks.0.attn.q_norm.weight", "blocks.1.ffn.norm.weight",
                 "blocks.0.attn.rope.freqs", "attn_pool.latent"):  # fmt: skip
        assert name in names, name
    assert "blocks.0.attn.qkv.weight" not in names and "attn_pool.kv.weight" not in names


def test_compute_skipping_drop_path_cuts_each_samples_positions():
    """With patch dropout each image keeps other patches, so each has its own positions: the
    skip mode's branch on the kept samples gets their rows (catches positions handed over uncut,
    or cut from the wrong rows)."""
    from pycls.models.vit.token_masks import add_kept_residual

    model = _model("rope axial", patch_drop=0.5).train()
    torch.manual_seed(3)
    x, positions = model.embed_with_positions(torch.randn(4, 3, 16, 16))
    assert positions.shape[0] == 4 and not torch.equal(positions[0], positions[1])
    block = model.blocks[0].eval()
    kept = torch.tensor([2, 0])
    with torch.no_grad():
        got = add_kept_residual(x, block._attention_branch, kept, 1.0, positions=positions)
        whole = x + block._attention_branch(x, None, positions)
    torch.testing.assert_close(got[kept], whole[kept], rtol=0, atol=1e-6)
    assert torch.equal(got[1], x[1]) and torch.equal(got[3], x[3])
