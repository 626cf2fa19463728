"""The scale-out zoo (ViT-g/14, ViT-G/14, ViT-22B's shape) and its configs: ``--mode info``'s
counts are exact (the built model's parameters, FlopCounterMode's FLOPs, on the meta device) and
give the published parameter counts; the bodies are timm's models of the same papers."""

import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pycls import config
from pycls.core import builders
from pycls.core.benchmark import print_info
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("single_thread")

# Parameters in millions as the papers count them: the encoder without class token or classifier
# (Zhai et al., "Scaling Vision Transformers", 2022, Table 2)
PUBLISHED_M = {"vit_g14": 1011, "vit_bigg14": 1843}
# Dehghani et al., "Scaling Vision Transformers to 22 Billion Parameters", 2023, Table 1: ViT-22B's
# own block (attention and MLP in parallel, QK-normalisation, no biases in the qkv projection and
# the LayerNorms); this library's standard block of the same shape has 0.04 % more
VIT_22B_M = 21_743
# timm's models of the same two papers' g/14 and G/14
TIMM = {"vit_g14": "vit_giant_patch14_224", "vit_bigg14": "vit_gigantic_patch14_224"}
NAMES = ["vit_g14", "vit_bigg14", "vit_22b14"]


def info(name):
    cfg = config.load_cfg(os.path.join(ROOT, "configs", f"{name}.yaml"), ["DATA.PATH", "/data"])
    return cfg, print_info(cfg)


def body_params(cfg, cx):
    """The parameters without the classifier (the configs' models have no class token)."""
    assert cfg.VIT.CLASSIFIER == "pooled" and not cfg.VIT.CLASS_TOKEN
    return cx["params"] - (cfg.VIT.WIDTH + 1) * cfg.MODEL.NUM_CLASSES


@pytest.mark.parametrize("name", NAMES)
def test_info_counts_are_the_built_models(name):
    cfg, cx = info(name)
    with torch.device("meta"):
        model = builders.build_model(cfg).eval()
    assert cx["params"] == sum(p.numel() for p in model.parameters())
    counter = FlopCounterMode(display=False)
    images = torch.empty(1, 3, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE, device="meta")
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(images)
    assert counter.get_total_flops() == 2 * cx["flops"]  # 2 FLOPs per multiply-add


@pytest.mark.parametrize("name", PUBLISHED_M)
def test_info_gives_the_published_parameter_counts(name):
    cfg, cx = info(name)
    assert round(body_params(cfg, cx) / 1e6) == PUBLISHED_M[name]


@pytest.mark.parametrize("name", TIMM)
def test_the_bodies_are_timms_models_of_the_paper(name):
    timm = pytest.importorskip("timm")
    cfg, cx = info(name)
    with torch.device("meta"):
        theirs = timm.create_model(TIMM[name], num_classes=0, class_token=False, global_pool="avg")
    assert body_params(cfg, cx) == sum(p.numel() for p in theirs.parameters())


def test_vit_22b_shape_is_the_papers_size_on_the_standard_block():
    cfg, cx = info("vit_22b14")
    body = body_params(cfg, cx) / 1e6
    assert 0 < body - VIT_22B_M < 0.0005 * VIT_22B_M
    assert cfg.VIT.NUM_HEADS % cfg.MESH.TP == 0 and cfg.VIT.MLP_DIM % cfg.MESH.TP == 0
