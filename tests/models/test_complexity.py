"""Analytic complexity checked against the built model, FlopCounterMode and forward hooks."""

import itertools

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pycls.models import VIT_SPECS, VisionTransformer, vit_complexity

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


SMALL = dict(
    image_size=32, patch_size=8, num_classes=10, depth=2, width=32, num_heads=4, mlp_dim=64
)
CONV_STEM = dict(
    stem="conv",
    conv_stem_channels=(8, 16, 16),
    conv_stem_kernels=(3, 5, 3),
    conv_stem_strides=(2, 2, 2),
)

KINDS = [
    dict(
        classifier=c,
        ffn=f,
        pos_embed=pe,
        representation_size=r,
        **(CONV_STEM if s == "conv" else {}),
    )
    for s, c, f, pe, r in itertools.product(
        ["patchify", "conv"],
        ["token", "pooled"],
        ["mlp", "local"],
        ["learned", "sincos"],
        [None, 16],
    )
]


def _kind_id(kind):
    parts = [kind.get("stem", "patchify"), kind["classifier"], kind["ffn"], kind["pos_embed"]]
    return "-".join(parts) + f"-r{kind['representation_size']}"


@pytest.mark.parametrize("kind", KINDS, ids=_kind_id)
def test_params_match_model(kind):
    model = VisionTransformer(**SMALL, **kind)
    assert model.complexity()["params"] == sum(p.numel() for p in model.parameters())


def counted_flops(model, images):
    """FLOPs of one forward pass as FlopCounterMode counts them, per op category.

    Attention runs on SDPA's math backend here, which decomposes into ``bmm`` on every torch
    version: the fused CPU kernels are ops that some versions' counter knows and others do not
    (torch 2.14 counts ``_scaled_dot_product_flash_attention_for_cpu`` as zero), so counting
    the fused op would check one version's bookkeeping rather than our arithmetic. FlopCounterMode
    counts 2 FLOPs per multiply-add and nothing for norms, activations, softmax or elementwise
    ops, as our definition does, so the match is exact.
    """
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(images)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), counts


@pytest.mark.parametrize("kind", KINDS, ids=_kind_id)
@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_flops_match_flop_counter(kind, layout):
    # The batch of 2 checks the count is per image.
    model = VisionTransformer(**SMALL, **kind, layout=layout).eval()
    total, counts = counted_flops(model, torch.randn(2, 3, 32, 32))
    assert total == 2 * 2 * model.complexity()["flops"]
    # The two attention matmuls (Q K^T and A V) per block, per image: 2 * heads * L^2 * d_head
    length = 16 + model.num_prefix_tokens
    attention = SMALL["depth"] * 2 * length**2 * SMALL["width"]
    assert counts["aten.bmm"] == 2 * 2 * attention


def test_flops_match_flop_counter_at_other_image_size():
    model = VisionTransformer(**SMALL, **CONV_STEM, ffn="local").eval()
    model.set_image_size(48)
    total, _ = counted_flops(model, torch.randn(1, 3, 48, 48))
    assert total == 2 * model.complexity()["flops"]
    assert model.complexity(image_size=32) == vit_complexity(**{**model.arch, "image_size": 32})


@pytest.mark.parametrize("kind", KINDS, ids=_kind_id)
def test_acts_match_forward_hooks(kind):
    model = VisionTransformer(**SMALL, **kind).eval()
    counted = []

    def count(module, args, output):
        counted.append(output[0].numel())  # per image: the batch has one sample

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            module.register_forward_hook(count)
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    length = 16 + model.num_prefix_tokens
    attention = SMALL["depth"] * (SMALL["num_heads"] * length**2 + length * SMALL["width"])
    assert model.complexity()["acts"] == sum(counted) + attention


# Reference values: torchvision documents these parameter counts and GFLOPS (its "GFLOPS" are
# multiply-adds) for vit_b_16, vit_b_32, vit_l_16 at 224 and vit_h_14 at 518.
TORCHVISION_REFERENCE = [
    ("vit_b16", 224, 86_567_656, 17.56),
    ("vit_b32", 224, 88_224_232, 4.41),
    ("vit_l16", 224, 304_326_632, 61.55),
    ("vit_h14", 518, 633_470_440, 1016.72),
]


@pytest.mark.parametrize("name, image_size, params, gflops", TORCHVISION_REFERENCE)
def test_zoo_matches_torchvision_reference(name, image_size, params, gflops):
    result = vit_complexity(**VIT_SPECS[name], image_size=image_size)
    assert result["params"] == params
    assert round(result["flops"] / 1e9, 2) == gflops


def test_zoo_stored_values():
    # Regression values of this implementation (pycls-style stored references).
    expected = {
        "vit_ti16": (1_253_683_200, 5_717_416, 5_974_636),
        "vit_s16": (4_598_882_304, 22_050_664, 11_948_272),
        "vit_b16": (17_563_828_224, 86_567_656, 23_895_544),
        "vit_h16": (127_314_872_320, 632_199_400, 100_813_288),
    }
    for name, (flops, params, acts) in expected.items():
        assert vit_complexity(**VIT_SPECS[name]) == dict(flops=flops, params=params, acts=acts)


# The block features, each on (and a few together): the count follows the built model
FEATURES = {
    "qk_norm layer": dict(qk_norm="layer"),
    "qk_norm rms, rms norms": dict(qk_norm="rms", norm_layer="rms"),
    "layer scale": dict(layer_scale_init=1e-5),
    "swiglu": dict(ffn="swiglu"),
    "swiglu packed, two thirds aligned": dict(ffn="swiglu_packed", ffn_width="two_thirds",
                                              ffn_align=24),
    "mlp norm": dict(ffn_norm=True, ffn="swiglu"),
    "rope mixed, no position table": dict(rope="mixed", pos_embed="none"),
    "rope axial": dict(rope="axial"),
    "attention pool": dict(classifier="map", class_token=False),
    "attention pool, registers": dict(classifier="map", num_registers=2, pre_norm=True),
    "parallel": dict(block="parallel", qk_norm="layer", layer_scale_init=0.1),
    "parallel bias-free": dict(block="parallel", qkv_bias=False, proj_bias=False),
    "parallel without qkv bias": dict(block="parallel", qkv_bias=False),
    "bias-free": dict(proj_bias=False, qkv_bias=False, ffn="swiglu"),
    "q and v biases": dict(key_bias=False),
    "features only": dict(num_classes=0, classifier="pooled"),
    "features only, distilled": dict(num_classes=0, dist_token=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FEATURES))
def test_features_are_counted_as_the_model_has_them(name):
    """Parameters against the built model, FLOPs against FlopCounterMode (a batch of 2, both
    layouts), activations against the linear layers' outputs plus the attention matrices and
    outputs (the blocks' and the attention pool's one query). Catches a feature whose
    parameters or products the analytic count leaves out or counts twice (a SwiGLU's second
    projection, the parallel block's fused ones, the pool's keys and values)."""
    kind = {**SMALL, **FEATURES[name]}
    model = VisionTransformer(**kind).eval()
    cx = model.complexity()
    assert cx["params"] == sum(p.numel() for p in model.parameters())
    for layout in ("batch_first", "batch_second"):
        laid = VisionTransformer(**kind, layout=layout).eval()
        total, _ = counted_flops(laid, torch.randn(2, 3, 32, 32))
        assert total == 2 * 2 * cx["flops"], layout
    counted = []
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            module.register_forward_hook(lambda m, a, out: counted.append(out[0].numel()))
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    length = 16 + model.num_prefix_tokens
    heads, width = SMALL["num_heads"], SMALL["width"]
    attention = SMALL["depth"] * (heads * length**2 + length * width)
    if model.args.classifier == "map":
        attention += heads * length + width
    assert cx["acts"] == sum(counted) + attention
