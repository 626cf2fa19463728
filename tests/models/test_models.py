"""Tests of the VisionTransformer: zoo variants, layouts, image size, regularisers, checks."""

import copy
import itertools
import os

import pytest
import torch
from torch import nn

from pycls.models import (
    VIT_SPECS,
    VisionTransformer,
    build_vit,
    resample_pos_embed,
    vit_complexity,
    vit_ti16,
)
from pycls.models.vit.blocks import DropPath
from pycls.models.vit.variants import list_vit_models
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


# A model small enough that every forward here takes milliseconds on two CPU cores.
SMALL = dict(
    image_size=32, patch_size=8, num_classes=10, depth=2, width=32, num_heads=4, mlp_dim=64
)
CONV_STEM = dict(
    stem="conv",
    conv_stem_channels=(8, 16, 16),
    conv_stem_kernels=(3, 3, 3),
    conv_stem_strides=(2, 2, 2),
)


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter and BatchNorm statistic non-trivial values (the head starts at 0)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            base = (
                1.0 if isinstance(module, nn.LayerNorm | nn.BatchNorm2d) and name == "weight" else 0
            )
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=gen))
            module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=gen))
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- zoo ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_vit_models())
@pytest.mark.parametrize("classifier", ["token", "pooled"])
def test_zoo_param_count_matches_meta_model(name, classifier):
    with torch.device("meta"):
        model = build_vit(name, classifier=classifier)
    assert model.pos_embed.is_meta
    assert num_params(model) == model.complexity()["params"]


@pytest.mark.parametrize("classifier", ["token", "pooled"])
def test_vit_h16_has_about_632m_params(classifier):
    params = vit_complexity(**VIT_SPECS["vit_h16"], classifier=classifier)["params"]
    assert 631.5e6 < params < 632.5e6


def test_list_models_and_unknown_name():
    assert list_vit_models() == sorted(VIT_SPECS)
    assert {"vit_ti16", "vit_s16", "vit_b16", "vit_b32", "vit_l16", "vit_h16", "vit_h14"} <= set(
        list_vit_models()
    )
    with pytest.raises(ValueError, match="vit_b17.*vit_b16"):
        build_vit("vit_b17")


def test_docs_vit_table_matches_the_code():
    with open(os.path.join(ROOT, "docs", "model_zoo.md")) as f:
        text = f.read()
    rows = text.split("<!-- vit table -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert sorted(c[0] for c in cells) == list_vit_models()
    for name, *sizes, params, flops, acts in cells:
        spec = VIT_SPECS[name]
        keys = ("patch_size", "depth", "width", "num_heads", "mlp_dim")
        assert [int(s) for s in sizes] == [spec[k] for k in keys], name
        cx = vit_complexity(**spec)  # the defaults: 224 px, 1000 classes, class token
        assert params == f"{cx['params'] / 1e6:.1f}" and flops == f"{cx['flops'] / 1e9:.2f}", name
        assert acts == f"{cx['acts'] / 1e6:.1f}", name


@pytest.mark.parametrize("name", list_vit_models())
@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_zoo_forward_shape(name, layout):
    """Two patches a side; the big variants keep one block so the test stays fast, and the
    biggest (one block of ViT-22B: 457 M parameters, 25 s to initialise) is built and run on the
    meta device, its shapes alone. Checked to fail, ViT-22B on the meta device too, with the
    MLP's second layer taking one input fewer than the first gives (blocks.Mlp)."""
    spec = VIT_SPECS[name]
    small = name in ("vit_ti16", "vit_s16")
    overrides = dict(image_size=2 * spec["patch_size"], num_classes=7, layout=layout)
    device = "meta" if spec["width"] * spec["mlp_dim"] > 10**8 else "cpu"
    with torch.device(device), torch.no_grad():
        model = build_vit(name, **overrides, **({} if small else {"depth": 1})).eval()
        out = model(torch.randn(2, 3, model.image_size, model.image_size))
    assert out.shape == (2, 7)


def test_vit_ti16_real_forward_at_32px():
    model = vit_ti16(image_size=32, num_classes=10)
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert out.shape == (2, 10)
    assert all(p.grad is not None for p in model.parameters())


# ---- layouts --------------------------------------------------------------------------------

VARIANTS = [
    dict(classifier=c, ffn=f, pos_embed=pe, **(CONV_STEM if s == "conv" else {}))
    for c, f, s, pe in itertools.product(
        ["token", "pooled"], ["mlp", "local"], ["patchify", "conv"], ["learned", "sincos"]
    )
]


def _variant_id(v):
    return "-".join([v.get("stem", "patchify"), v["classifier"], v["ffn"], v["pos_embed"]])


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_layouts_give_identical_logits(variant):
    first = randomize(VisionTransformer(**SMALL, **variant, layout="batch_first")).eval()
    second = VisionTransformer(**SMALL, **variant, layout="batch_second").eval()
    second.load_state_dict(first.state_dict(), strict=True)
    assert second.pos_embed.shape == first.pos_embed.shape  # layout-independent checkpoints
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        tokens_first, tokens_second = first.forward_features(x), second.forward_features(x)
        assert tokens_first.shape[0] == 3 and tokens_second.shape[1] == 3
        torch.testing.assert_close(tokens_second.transpose(0, 1), tokens_first, rtol=0, atol=1e-5)
        torch.testing.assert_close(second(x), first(x), rtol=0, atol=1e-5)


def test_patch_embed_returns_tokens_in_layout_without_class_token():
    for layout, shape in [("batch_first", (2, 16, 32)), ("batch_second", (16, 2, 32))]:
        model = VisionTransformer(**SMALL, layout=layout)
        assert model.patch_embed(torch.randn(2, 3, 32, 32)).shape == shape
        assert model.embed(torch.randn(2, 3, 32, 32)).shape[:2] == (
            (2, 17) if layout == "batch_first" else (17, 2)
        )


def test_pooled_classifier_has_no_class_token():
    model = VisionTransformer(**SMALL, classifier="pooled")
    assert model.class_token is None
    assert model.pos_embed.shape == (1, 16, 32)


# ---- image size -----------------------------------------------------------------------------


@pytest.mark.parametrize("classifier", ["token", "pooled"])
@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_set_image_size_resamples_in_place(classifier, layout):
    model = VisionTransformer(**SMALL, classifier=classifier, layout=layout, ffn="local")
    param = model.pos_embed
    prefix = model.num_prefix_tokens
    old = param.detach().clone()
    model.set_image_size(48)
    assert model.pos_embed is param
    assert param.shape == (1, prefix + 36, 32)
    assert model.image_size == 48 and model.grid_size == 6
    if prefix:
        torch.testing.assert_close(param[:, :1], old[:, :1], rtol=0, atol=0)
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 10)
    assert model.complexity() == vit_complexity(**{**model.arch, "image_size": 48})
    # Another input size resamples on the fly and leaves the stored table as it is
    stored = param.detach().clone()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert torch.equal(param.detach(), stored)
    with pytest.raises(ValueError, match="36"):
        model(torch.randn(2, 3, 36, 36))


@pytest.mark.parametrize("pos_embed", ["learned", "sincos"])
@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_other_input_size_matches_a_resized_copy(pos_embed, layout):
    """Evaluating at 48 px equals a copy switched to 48 px with set_image_size."""
    model = VisionTransformer(**SMALL, pos_embed=pos_embed, layout=layout).eval()
    resized = copy.deepcopy(model)
    resized.set_image_size(48)
    x = torch.randn(2, 3, 48, 48)
    torch.testing.assert_close(model(x), resized(x), rtol=1e-5, atol=1e-5)


def test_resampling_to_the_same_grid_is_identity():
    model = VisionTransformer(**SMALL)
    table = model.pos_embed.detach().clone()
    torch.testing.assert_close(resample_pos_embed(table, 4), table, rtol=0, atol=1e-6)
    model.set_image_size(32)
    torch.testing.assert_close(model.pos_embed.detach(), table, rtol=0, atol=1e-6)


def test_resample_pos_embed_infers_prefix_and_keeps_smooth_tables():
    # A table linear in x and y stays (nearly) linear after bicubic upsampling.
    ys, xs = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    plane = (xs + 2 * ys).reshape(1, 16, 1)
    with_prefix = torch.cat([torch.full((1, 1, 1), 7.0), plane], dim=1)
    up = resample_pos_embed(with_prefix, 8)
    assert up.shape == (1, 65, 1) and up[0, 0, 0] == 7.0
    assert resample_pos_embed(plane, (8, 8)).shape == (1, 64, 1)
    grid = up[0, 1:, 0].reshape(8, 8)
    assert (grid[:, 1:] - grid[:, :-1]).mean() == pytest.approx(0.5, abs=0.05)


def test_set_image_size_recomputes_sincos():
    model = VisionTransformer(**SMALL, pos_embed="sincos")
    assert "pos_embed" not in dict(model.named_parameters())
    model.set_image_size(48)
    fresh = VisionTransformer(**{**SMALL, "image_size": 48}, pos_embed="sincos")
    torch.testing.assert_close(model.pos_embed, fresh.pos_embed, rtol=0, atol=0)
    assert model.pos_embed[0, 0].abs().sum() == 0  # class-token slot


def test_set_image_size_rejects_bad_size():
    model = VisionTransformer(**SMALL)
    with pytest.raises(ValueError, match=r"50.*8"):
        model.set_image_size(50)


@pytest.mark.parametrize("pos_embed", ["learned", "sincos"])
def test_state_dict_from_other_image_size_loads(pos_embed):
    small = randomize(VisionTransformer(**SMALL, pos_embed=pos_embed))
    big = VisionTransformer(**{**SMALL, "image_size": 48}, pos_embed=pos_embed)
    state = small.state_dict()
    big.load_state_dict(state, strict=True)
    assert state["pos_embed"].shape == (1, 17, 32)  # the caller's dict is left alone
    if pos_embed == "learned":
        expected = resample_pos_embed(small.pos_embed.detach(), 6)
    else:
        expected = VisionTransformer(**{**SMALL, "image_size": 48}, pos_embed="sincos").pos_embed
    torch.testing.assert_close(big.pos_embed.detach(), expected, rtol=0, atol=0)
    torch.testing.assert_close(big.head.weight, small.head.weight, rtol=0, atol=0)
    assert big(torch.randn(1, 3, 48, 48)).shape == (1, 10)


def test_meta_model_materialises_with_init_weights():
    with torch.device("meta"):
        model = VisionTransformer(**SMALL, pos_embed="sincos")
    model.to_empty(device="cpu")
    model.init_weights()
    reference = VisionTransformer(**SMALL, pos_embed="sincos")
    torch.testing.assert_close(model.pos_embed, reference.pos_embed, rtol=0, atol=0)
    assert torch.isfinite(model(torch.randn(1, 3, 32, 32))).all()


@pytest.mark.parametrize(
    "features",
    [
        dict(layer_scale_init=0.1, key_bias=False, rope="mixed", classifier="map", qk_norm="rms"),
        dict(block="parallel", qkv_bias=False, rope="axial", ffn_align=48, layer_scale_init=0.1),
        dict(ffn="swiglu_packed", ffn_norm=True, norm_layer="rms", pos_embed="none"),
    ],
    ids=["attention", "parallel", "feed-forward"],
)
def test_meta_model_with_the_block_features_materialises_with_init_weights(features):
    """init_weights after to_empty sets every parameter the block features add (storage the
    meta device left as garbage): LayerScale to its value, the biases outside a Linear to zero,
    a mixed RoPE's frequencies, the probe; the same as a model built on the CPU but for the
    random draws."""
    with torch.device("meta"):
        model = VisionTransformer(**SMALL, **features)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.init_weights()
    reference = VisionTransformer(**SMALL, **features)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.isfinite(p).all(), name
        if name.endswith(("gamma", "q_bias", "v_bias", "mlp_bias")):
            assert torch.equal(p, q), name
    assert torch.isfinite(model(torch.randn(1, 3, 32, 32))).all()


# ---- regularisers and checkpointing ---------------------------------------------------------


@pytest.mark.parametrize("batch_dim", [0, 1])
def test_drop_path_drops_whole_samples(batch_dim):
    drop = DropPath(0.5, batch_dim=batch_dim).train()
    shape = [5, 5, 3]
    shape[batch_dim] = 64
    out = drop(torch.ones(shape)).movedim(batch_dim, 0).reshape(64, -1)
    per_sample = out[:, 0]
    assert torch.equal(out, per_sample[:, None].expand_as(out))  # all tokens of a sample agree
    assert set(per_sample.tolist()) == {0.0, 2.0}
    assert torch.equal(drop.eval()(torch.ones(shape)), torch.ones(shape))


def test_drop_path_rate_is_a_float32_tensor_kept_through_casts_and_the_meta_device():
    """The rate reaches ``forward`` as a float32 buffer (one compiled graph for every rate): set
    later, cast to half, built on the meta device or cast by AMP O2, it still says 1 - p."""
    from pycls.engines.precision import Precision
    from pycls.models.vit.blocks import place_rates

    drop = DropPath(0.25)
    assert drop.keep_prob.dtype == torch.float32 and drop.keep_prob.item() == 0.75
    assert drop.state_dict() == {} and "p=0.25" in repr(drop)  # checkpoints as before
    drop.p = 0.5  # a later rate (a schedule, a fine-tuning run)
    assert drop.keep_prob.item() == 0.5 and drop.active and "p=0.5" in repr(drop)
    drop.p = 0.0
    x = torch.randn(4, 3)
    assert not drop.active and drop.train()(x) is x
    with pytest.raises(ValueError, match="drop-path rate"):
        drop.p = 1.0
    want = [1 - i * 0.1 / 3 for i in range(4)]  # 1 - p in float32, never rounded to half
    four = {**SMALL, "depth": 4}
    for level in ("O2", "O3"):
        model = Precision(level).prepare_model(VisionTransformer(**four, drop_path=0.1))
        assert model.head.weight.dtype == torch.bfloat16
        keeps = [b.drop_path.keep_prob for b in model.blocks]
        assert all(k.dtype == torch.float32 for k in keeps), level
        assert [k.item() for k in keeps] == pytest.approx(want, abs=1e-7), level
    with torch.device("meta"):
        model = VisionTransformer(**four, drop_path=0.1)
    model.to_empty(device="cpu")  # the engines' materialisation
    assert [b.drop_path.keep_prob.item() for b in model.blocks] == pytest.approx(want, abs=1e-7)
    with torch.device("meta"):
        model = VisionTransformer(**four, drop_path=0.1)
    state = VisionTransformer(**four).state_dict()
    model.load_state_dict(state, assign=True)  # the importers' fill: the rates stay on meta
    assert model.blocks[1].drop_path.keep_prob.is_meta
    place_rates(model, "cpu")
    assert [b.drop_path.keep_prob.item() for b in model.blocks] == pytest.approx(want, abs=1e-7)
    model.train()(torch.randn(2, 3, 32, 32)).sum().backward()


def test_drop_path_rates_increase_linearly():
    model = VisionTransformer(**{**SMALL, "depth": 5}, drop_path=0.2)
    rates = [block.drop_path.p for block in model.blocks]
    assert rates == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])


def test_uniform_drop_path_rates_are_deit3s():
    """drop_path_schedule "uniform" gives every block the rate, as DeiT III's models_v2.py
    (facebookresearch/deit at 7e160fe, vit_models: ``dpr = [drop_path_rate for i in
    range(depth)]``) trains; the config key reaches the model. Caught: the schedule ignored (the
    linear rates), or a uniform rate that leaves the first block at 0."""
    from pycls import config
    from pycls.core.builders import build_model

    model = VisionTransformer(**{**SMALL, "depth": 5}, drop_path=0.2, drop_path_schedule="uniform")
    assert [block.drop_path.p for block in model.blocks] == pytest.approx([0.2] * 5)
    tiny = ["VIT.DEPTH", "3", "VIT.WIDTH", "32", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64"]
    overrides = [*tiny, "VIT.DROP_PATH", "0.45", "VIT.DROP_PATH_SCHEDULE", "uniform"]
    cfg = config.load_cfg(None, overrides)
    built = build_model(cfg)
    assert [block.drop_path.p for block in built.blocks] == pytest.approx([0.45] * 3)
    with pytest.raises(config.ConfigError, match="VIT.DROP_PATH_SCHEDULE"):
        config.load_cfg(None, ["VIT.DROP_PATH_SCHEDULE", "constant"])


@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_dropout_and_drop_path_only_in_training(layout):
    model = VisionTransformer(
        **SMALL, layout=layout, ffn="local", dropout=0.3, attn_dropout=0.3, drop_path=0.3
    )
    randomize(model)
    x = torch.randn(4, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
        clean = model(x)
        model.train()
        assert not torch.allclose(model(x), model(x))
        assert not torch.allclose(model(x), clean)


@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_checkpoint_blocks_gives_same_gradients(layout):
    regularised = dict(SMALL, depth=3, layout=layout, dropout=0.1, drop_path=0.2, attn_dropout=0.1)
    plain = randomize(VisionTransformer(**regularised)).train()
    ckpt = VisionTransformer(**regularised, checkpoint_blocks=2).train()
    ckpt.load_state_dict(plain.state_dict())
    calls = []
    for block in ckpt.blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    x = torch.randn(4, 3, 32, 32)
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(0)
        model(x).square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert len(calls) == 3 + 2  # the two checkpointed blocks ran again in backward
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-6, msg=name)


# ---- weight decay and validation ------------------------------------------------------------


def test_no_weight_decay_names():
    model = VisionTransformer(**SMALL, **CONV_STEM, ffn="local", representation_size=16)
    names = model.no_weight_decay_names()
    params = dict(model.named_parameters())
    assert {"pos_embed", "class_token", "norm.weight", "norm.bias", "head.bias"} <= names
    assert {"blocks.0.ln_1.weight", "blocks.1.ln_2.bias", "patch_embed.body.0.bn.weight"} <= names
    assert {"blocks.0.ffn.dwconv.bias", "pre_logits.0.bias", "patch_embed.proj.bias"} <= names
    assert all(params[n].ndim <= 1 for n in names - {"pos_embed", "class_token"})
    decayed = set(params) - names
    assert all(params[n].ndim >= 2 for n in decayed)
    assert {"blocks.0.attn.qkv.weight", "head.weight", "blocks.0.ffn.dwconv.weight"} <= decayed
    sincos = VisionTransformer(**SMALL, classifier="pooled", pos_embed="sincos")
    assert not {"pos_embed", "class_token"} & sincos.no_weight_decay_names()


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (dict(stem="resnet"), r"stem 'resnet'.*'patchify', 'conv'"),
        (dict(classifier="gap"), r"classifier 'gap'.*'token', 'pooled'"),
        (dict(layout="nld"), r"layout 'nld'.*'batch_first', 'batch_second'"),
        (dict(ffn="glu"), r"ffn 'glu'.*'mlp', 'local'"),
        (dict(pos_embed="rope"), r"pos_embed 'rope'.*'learned', 'sincos'"),
        (dict(image_size=30), r"image_size 30.*patch_size 8"),
        (dict(num_heads=5), r"width 32.*num_heads 5"),
        (dict(width=30, num_heads=3, pos_embed="sincos"), r"divisible by 4.*30"),
        (dict(CONV_STEM, conv_stem_strides=(2, 2, 1)), r"\(2, 2, 1\).*4.*patch_size 8"),
        (dict(CONV_STEM, conv_stem_kernels=(3, 3)), "same non-zero length"),
        (dict(CONV_STEM, conv_stem_kernels=(3, 4, 3)), r"odd.*\(3, 4, 3\)"),
        (dict(stem="conv"), "same non-zero length"),
        (dict(drop_path=1.0), r"drop_path.*1\.0"),
        (dict(checkpoint_blocks=3), r"checkpoint_blocks.*depth=2.*3"),
        (dict(representation_size=0), "representation_size"),
    ],
)
def test_constructor_validation(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        VisionTransformer(**{**SMALL, **overrides})


def test_patchify_ignores_conv_stem_arguments():
    model = VisionTransformer(**SMALL, conv_stem_channels=(8,), conv_stem_kernels=(3,))
    assert num_params(model) == model.complexity()["params"]


# ---- the attention kernel (VIT.ATTENTION_BACKEND) ------------------------------------------------


class _RecordedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the aten operators that run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.__name__)
        return func(*args, **(kwargs or {}))


def test_math_attention_kernel_is_pinned_and_matches_default():
    """attention_backend "math" runs SDPA's math kernel (softmax and batched matmuls) where
    torch picks its CPU flash kernel by default, and gives the same logits and gradients
    (measured: identical to 1e-7; allowed 1e-5)."""
    out = {}
    for backend in ("default", "math"):
        torch.manual_seed(0)
        model = randomize(VisionTransformer(**SMALL, attention_backend=backend))
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        with _RecordedOps() as recorded:
            logits = model(x)
            logits.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        out[backend] = logits.detach(), grads, recorded.ops
    assert any("flash_attention" in op for op in out["default"][2])
    assert not any("flash_attention" in op for op in out["math"][2])
    assert "_safe_softmax.default" in out["math"][2] or "_softmax.default" in out["math"][2]
    torch.testing.assert_close(out["math"][0], out["default"][0], rtol=1e-5, atol=1e-5)
    for name, g in out["default"][1].items():
        torch.testing.assert_close(out["math"][1][name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_pinned_attention_kernel_compiles_in_the_blocks_graph():
    """torch.compile traces the sdpa_kernel context: one graph for the blocks, no graph break."""
    from torch._dynamo.utils import counters

    from pycls.engines.base import compile_model

    torch._dynamo.reset()
    counters.clear()
    model = VisionTransformer(**SMALL, attention_backend="math").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        compile_model(model, "blocks", backend="eager")
        got = model(x)
    torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unknown_attention_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend 'fast'"):
        VisionTransformer(**SMALL, attention_backend="fast")


def test_a_cuda_attention_kernel_is_refused_where_device_auto_finds_no_gpu(monkeypatch):
    """DEVICE auto is read as written; the machine step resolves it (cpu where there is no GPU)
    and the resolved config refuses the kernel, before any model is built."""
    from pycls import config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides = ["VIT.ATTENTION_BACKEND", "efficient", "VIT.DEPTH", "1"]
    assert config.read_cfg(None, overrides).DEVICE == "auto"
    with pytest.raises(config.ConfigError, match=r"^VIT\.ATTENTION_BACKEND: .*DEVICE cpu"):
        config.load_cfg(None, overrides)


# ---- DeiT III ------------------------------------------------------------------------------

DEIT3 = {"deit3_s16": "deit3_small_patch16_224", "deit3_b16": "deit3_base_patch16_224",
         "deit3_l16": "deit3_large_patch16_224", "deit3_h14": "deit3_huge_patch14_224"}  # fmt: skip


@pytest.mark.parametrize("name", list(DEIT3))
def test_deit3_variants_are_timms_deit3(name):
    """The zoo's DeiT III is timm's definition (sizes, LayerScale at its initial value, class
    token, qkv bias): the same parameters but the class token's position row, which timm's
    no_embed_class leaves out (built on the meta device: no memory, no initialisation)."""
    timm = pytest.importorskip("timm")
    import pycls.models as models

    with torch.device("meta"):
        ours = getattr(models, name)()
        theirs = timm.create_model(DEIT3[name], pretrained=False)
    assert ours.args.layer_scale_init == theirs.blocks[0].ls1.init_values == 1e-6
    extra = ours.width  # the class token's row of the position table
    assert num_params(ours) == sum(p.numel() for p in theirs.parameters()) + extra
    assert type(ours.blocks[0].ls_1).__name__ == "LayerScale"


def test_model_arch_of_deit3_sets_layer_scale():
    """MODEL.ARCH deit3_b16 gives its sizes and its LayerScale (every key of the variant, not the
    sizes alone), which a config may still override."""
    from pycls import config

    cfg = config.load_cfg(None, ["MODEL.ARCH", "deit3_b16"])
    assert (cfg.VIT.WIDTH, cfg.VIT.LAYER_SCALE_INIT) == (768, 1e-6)
    cfg = config.load_cfg(None, ["MODEL.ARCH", "vit_b16"])
    assert cfg.VIT.LAYER_SCALE_INIT == 0.0
