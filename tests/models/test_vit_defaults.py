"""The ViT's options left at their defaults build the model they built before the block features
(QK-norm, LayerScale, SwiGLU, RoPE, the attention-pool head, parallel blocks, RMSNorm, bias-free
projections) were added: the same state-dict keys and shapes, the same random draws, and the same
logits at a fixed seed, held to values recorded from the code before them
(``tests/data/vit_before_block_features.json``).

Logits are held to float32 rounding (1e-6): on the machine that recorded them they are equal bit
for bit, and another CPU's kernels may round a last bit differently; the keys, the shapes and
the number of random draws (the next draw after building) are exact everywhere.
"""

import json
import pathlib

import pytest
import torch

from pycls.models import VisionTransformer

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

FIXTURE = pathlib.Path(__file__).parents[1] / "data" / "vit_before_block_features.json"

SIZES = dict(image_size=32, patch_size=8, depth=2, width=32, num_heads=2, mlp_dim=64,
             num_classes=5, head_init_scale=1.0)  # fmt: skip
CONV_STEM = dict(stem="conv", conv_stem_channels=(8, 16), conv_stem_kernels=(3, 3),
                 conv_stem_strides=(2, 4))  # fmt: skip
# Today's options, between them each away from its default; "train" ones run a training forward
CONFIGS = {
    "token": dict(),
    "pooled registers batch_second": dict(
        classifier="pooled", num_registers=2, layout="batch_second"
    ),
    "conv stem local ffn sincos": dict(
        CONV_STEM, classifier="pooled", class_token=True, ffn="local", pos_embed="sincos"
    ),
    "distilled pre-norm no qkv bias": dict(dist_token=True, pre_norm=True, qkv_bias=False),
    "fc-norm representation": dict(classifier="pooled", fc_norm=True, representation_size=24),
    "train: drop path, dropout, patch dropout": dict(
        classifier="pooled", drop_path=0.2, dropout=0.1, patch_drop=0.3
    ),
    "train: drop path skip, batch_second": dict(
        drop_path=0.5, drop_path_mode="skip", layout="batch_second", num_registers=1
    ),
}


def build(name):
    """The model of ``name`` built at seed 0, the next random draw, and its logits on fixed
    images (in training mode for the "train" configurations, at seed 1)."""
    torch.manual_seed(0)
    model = VisionTransformer(**SIZES, **CONFIGS[name])
    next_draw = torch.rand(3)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    model.train(name.startswith("train"))
    torch.manual_seed(1)
    with torch.no_grad():
        logits = model(images)
    return model, next_draw, logits


def record():
    """The fixture's values from the code as it is (run once, before the block features)."""
    out = {}
    for name in CONFIGS:
        model, draw, logits = build(name)
        keys = [[k, list(v.shape)] for k, v in model.state_dict().items()]
        out[name] = {"keys": keys, "next_draw": draw.tolist(), "logits": logits.tolist()}
    return out


RECORDED = json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_defaults_build_the_model_they_built_before(name):
    """Catches a default that changed the model: a new parameter or buffer built while its option
    is off (a LayerScale of ones, a norm of the queries), one renamed, one more random draw
    at initialisation (an option's module drawing its init even when off), or another result
    (an identity RoPE or an extra cast on the default path)."""
    want = RECORDED[name]
    model, draw, logits = build(name)
    assert [[k, list(v.shape)] for k, v in model.state_dict().items()] == want["keys"]
    assert draw.tolist() == want["next_draw"]
    torch.testing.assert_close(logits, torch.tensor(want["logits"]), rtol=1e-6, atol=1e-6)
