"""The CNN families' analytic complexity: upstream pycls's published numbers for every config of
its complexity data (tests/data/upstream_model_complexity.json, which names its source), the
built models' parameter counts, FlopCounterMode and forward hooks."""

import json
import os

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pycls.config import assert_cfg, get_default_cfg
from pycls.core import builders
from pycls.models.cnn.anynet import AnyNet
from pycls.models.cnn.effnet import EffNet
from pycls.models.cnn.regnet import RegNet, quantized_widths, regnet_complexity, regnet_to_anynet
from pycls.models.cnn.resnet import ResNet
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

DATA = os.path.join(ROOT, "tests", "data", "upstream_model_complexity.json")
with open(DATA) as f:
    UPSTREAM = json.load(f)["models"]


def upstream_cfg(model_keys):
    """Our config with upstream's model keys merged in (the data set named for the layout)."""
    c = get_default_cfg()
    keys = json.loads(json.dumps(model_keys))  # a copy
    train = keys.pop("TRAIN")
    for section, values in keys.items():
        for key, value in values.items():
            default = c[section][key]
            c[section][key] = float(value) if isinstance(default, float) else value
    # Upstream's "imagenet" is an image folder here; the layout only cares whether it is CIFAR.
    dataset = "cifar10" if "cifar" in train["DATASET"] else "imagefolder"
    c.TRAIN.DATASET = c.TEST.DATASET = dataset
    c.DATA.PATH = "/data/unused"
    c.TRAIN.IM_SIZE = c.TEST.IM_SIZE = train["IM_SIZE"]
    assert_cfg(c)
    return c


def test_data_file_covers_upstream():
    assert len(UPSTREAM) == 65  # every config of upstream's dev/model_complexity.json
    types = {v["config"]["MODEL"]["TYPE"] for v in UPSTREAM.values()}
    assert types == {"anynet", "regnet", "resnet", "effnet"}


@pytest.mark.parametrize("path", sorted(UPSTREAM))
def test_complexity_equals_upstream(path):
    c = upstream_cfg(UPSTREAM[path]["config"])
    with torch.device("meta"):  # shapes only: the big models allocate nothing
        model = builders.build_model(c)
    cx = model.complexity(c.TRAIN.IM_SIZE)
    assert cx == UPSTREAM[path]["complexity"]
    assert cx["params"] == sum(p.numel() for p in model.parameters())


def test_regnet_quantized_widths():
    # RegNetX-200MF: the paper's Table / upstream's model: widths 24, 56, 152, 368; depths 1 1 4 7
    assert quantized_widths(36.44, 24, 2.49, 13) == ([24, 56, 152, 368], [1, 1, 4, 7])
    # RegNetY-800MF: the rule gives 56, 136, 320, 776; the group width 16 moves them to the
    # nearest multiples, ties to even (as upstream and timm's regnety_008: 64, 128, 320, 768)
    assert quantized_widths(38.84, 56, 2.4, 14) == ([56, 136, 320, 776], [1, 3, 8, 2])
    anynet = regnet_to_anynet(w_a=38.84, w_0=56, w_m=2.4, depth=14, group_w=16, se_r=0.25)
    assert anynet["widths"] == (64, 128, 320, 768) and anynet["depths"] == (1, 3, 8, 2)


def _bias_flops(model, images):
    """Output elements of layers with a bias, per image: upstream counts one addition each,
    FlopCounterMode none."""
    total = []

    def count(module, args, output):
        if module.bias is not None:
            total.append(output[0].numel())

    hooks = [
        m.register_forward_hook(count)
        for m in model.modules()
        if isinstance(m, nn.Conv2d | nn.Linear)
    ]
    with torch.no_grad():
        model(images[:1])
    for h in hooks:
        h.remove()
    return sum(total)


def _hook_acts(model, images):
    counted = []

    def count(module, args, output):
        counted.append(output[0].numel())

    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear | nn.MaxPool2d):
            m.register_forward_hook(count)
    with torch.no_grad():
        model(images[:1])
    return sum(counted)


SMALL_MODELS = {
    "anynet_vanilla_cifar": lambda: AnyNet(
        stem_type="res_stem_cifar",
        stem_w=8,
        block_type="vanilla_block",
        depths=(1, 2),
        widths=(8, 16),
        strides=(1, 2),
        num_classes=10,
    ),
    "anynet_basic_in": lambda: AnyNet(
        stem_type="res_stem_in",
        stem_w=8,
        block_type="res_basic_block",
        depths=(2, 1),
        widths=(8, 24),
        strides=(1, 2),
        head_w=32,
        num_classes=10,
    ),
    "anynet_linear_se": lambda: AnyNet(
        block_type="res_bottleneck_linear_block",
        stem_w=16,
        depths=(2, 2),
        widths=(16, 32),
        strides=(1, 2),
        bot_muls=(2.0, 0.5),
        group_ws=(8, 16),
        se_r=0.25,
        num_classes=10,
    ),
    "regnety": lambda: RegNet(w_a=8.0, w_0=16, w_m=2.0, depth=5, group_w=8, se_r=0.25),
    "resnext_imagenet": lambda: ResNet(
        depth=50, num_groups=4, width_per_group=4, num_classes=10, stride_1x1=False
    ),
    "resnet_cifar": lambda: ResNet(
        depth=8, layout="cifar", trans_fun="basic_transform", num_classes=10
    ),
    "effnet": lambda: EffNet(
        stem_w=8,
        depths=(1, 2),
        widths=(8, 16),
        exp_ratios=(1, 4),
        strides=(1, 2),
        kernels=(3, 5),
        head_w=32,
        num_classes=10,
    ),
}


@pytest.mark.parametrize("name", sorted(SMALL_MODELS))
@pytest.mark.parametrize("size", [32, 45])
def test_flops_and_acts_match_counters(name, size):
    # 45 px: odd sizes check the (h - 1) // stride + 1 rule of padded strided convs and pools.
    model = SMALL_MODELS[name]().eval()
    images = torch.randn(2, 3, size, size)
    cx = model.complexity(size)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(images)
    # FlopCounterMode: 2 FLOPs per multiply-add, for the batch of 2, biases not counted.
    assert counter.get_total_flops() == 2 * 2 * (cx["flops"] - _bias_flops(model, images))
    assert cx["acts"] == _hook_acts(model, images)
    assert cx["params"] == sum(p.numel() for p in model.parameters())


def test_regnet_complexity_function_matches_model():
    kw = dict(w_a=8.0, w_0=16, w_m=2.0, depth=5, group_w=8, se_r=0.25)
    assert regnet_complexity(image_size=64, num_classes=7, **kw) == RegNet(
        num_classes=7, **kw
    ).complexity(64)
