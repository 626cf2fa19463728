"""The ViT's one home: one argument list (VitArgs) that the model, its complexity and the config
all read, and the parallel plans the engines cut it by, beside the model."""

import dataclasses
import inspect

import pytest
import torch

from pycls.config.sections import model_vit
from pycls.models import AnyNet, VisionTransformer
from pycls.models.parallel_plans import parallel_plan
from pycls.models.vit.args import TRAINING_ONLY_ARGS, UNCOUNTED, VitArgs
from pycls.models.vit.complexity import vit_complexity

TINY = dict(image_size=16, patch_size=4, depth=2, width=32, num_heads=2, mlp_dim=64)


def test_one_argument_list_for_the_model_its_complexity_and_the_config():
    fields = {f.name: f.default for f in dataclasses.fields(VitArgs)}
    for fn in (VisionTransformer, vit_complexity):
        params = inspect.signature(fn).parameters
        keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
        assert keywords == fields, fn
    assert set(model_vit.VIT_ARGS) <= set(fields)  # what the VIT keys become: its fields
    assert set(fields) >= TRAINING_ONLY_ARGS and set(fields) >= UNCOUNTED
    assert VisionTransformer.TRAINING_ONLY_ARGS == TRAINING_ONLY_ARGS


def test_the_model_keeps_its_record_and_its_complexity_counts_it():
    args = VitArgs(**TINY, num_classes=10, classifier="pooled", num_registers=2)
    model = VisionTransformer(args)
    assert model.args == args and model.args is not args  # a copy: set_image_size changes its own
    assert model.arch == dataclasses.asdict(args)
    counted = vit_complexity(args)
    assert counted == model.complexity() == vit_complexity(**model.arch)
    assert counted["params"] == sum(p.numel() for p in model.parameters())
    model.set_image_size(24)
    assert model.args.image_size == 24 and args.image_size == 16
    with pytest.raises(ValueError, match="divisible by num_heads"):
        VisionTransformer(**{**TINY, "num_heads": 3})


def test_the_engines_cut_a_model_through_its_plan():
    vit = VisionTransformer(**TINY, num_classes=10)
    plan = parallel_plan(vit, "pipeline")
    ranges = plan.chunk_ranges(2)
    assert ranges == [range(0, 1), range(1, 2)]
    first, last = plan.chunk(ranges[0], True, False), plan.chunk(ranges[1], False, True)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(last(first(images)), vit(images), rtol=0, atol=0)
    assert plan.tokens(16, 16) == vit.num_prefix_tokens + 16
    cnn = AnyNet(stem_type="simple_stem_in", stem_w=8, block_type="res_basic_block",
                 depths=(1,), widths=(8,), strides=(1,), num_classes=10)  # fmt: skip
    with pytest.raises(ValueError, match="TRAIN.PARALLEL tensor: AnyNet has no plan"):
        parallel_plan(cnn, "tensor")
