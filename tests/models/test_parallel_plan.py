"""The ViT's parallel plans know every parameter the model can have: the tensor-parallel plan
(``pycls.models.vit.tensor_plan``) declares each sharded or replicated (its gradient whole in
every process), or names the feature the engine x feature rule refuses under it, and places them
as declared; the pipeline chunks (``pipeline_cut``) hold each parameter once, the refused
features' aside."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pycls.engines.support import UNSUPPORTED
from pycls.models import VisionTransformer
from pycls.models.parallel_plans import parallel_plan
from pycls.models.vit import tensor_plan
from pycls.models.vit.args import TRAINING_ONLY_ARGS, VitArgs

SIZES = dict(image_size=16, patch_size=4, depth=2, width=32, num_heads=2, mlp_dim=64)
# Between them, every option that shapes the model (every field but the training-only ones) away
# from its default: each parameter an option can add is in one of these models
MODELS = {
    "conv stem, registers, pre-norm, fc-norm, representation, local ffn": dict(
        SIZES,
        in_channels=1,
        num_classes=10,
        stem="conv",
        conv_stem_channels=(8, 16),
        conv_stem_kernels=(3, 3),
        conv_stem_strides=(2, 2),
        classifier="pooled",
        class_token=True,
        num_registers=2,
        qkv_bias=False,
        pre_norm=True,
        fc_norm=True,
        representation_size=24,
        ffn="local",
        pos_embed="sincos",
        norm_eps=1e-5,
    ),
    "distillation token": dict(SIZES, num_classes=10, dist_token=True),
    "block features: QK-norm, LayerScale, SwiGLU, RoPE, attention pool, RMSNorm": dict(
        SIZES,
        num_classes=10,
        qk_norm="rms",
        layer_scale_init=1e-5,
        ffn="swiglu",
        ffn_width="two_thirds",
        ffn_align=8,
        ffn_norm=True,
        pos_embed="none",
        rope="mixed",
        rope_temperature=10.0,
        rope_grid_indexing="xy",
        classifier="map",
        class_token=True,
        norm_layer="rms",
        key_bias=False,
        proj_bias=False,
    ),
    "parallel blocks, axial RoPE": dict(
        SIZES,
        num_classes=10,
        block="parallel",
        rope="axial",
        rope_ref_grid=8,
        rope_layout="half",
        qkv_bias=False,  # the MLP's own bias
    ),
    "packed SwiGLU, DINOv3's RoPE": dict(SIZES, num_classes=10, ffn="swiglu_packed", rope="dinov3"),
}


def test_the_models_turn_on_every_option_that_shapes_the_model():
    """A new option that is not training-only may add parameters: it joins one of MODELS, so
    that the tests below ask the plans about them."""
    defaults = {f.name: f.default for f in dataclasses.fields(VitArgs)}
    shaping = set(defaults) - TRAINING_ONLY_ARGS
    turned_on = {n for kwargs in MODELS.values() for n, v in kwargs.items() if v != defaults[n]}
    assert shaping - turned_on == set(), "add these options to a model of MODELS"


@pytest.mark.parametrize("name", MODELS)
def test_the_tensor_plan_places_every_parameter(name):
    """Every parameter is declared sharded or replicated, or belongs to a feature the engine x
    feature rule refuses under tensor parallelism (its row there says why). The one refused is
    DeiT's distillation token: the engine gathers the group's batch inside its step, where a
    teacher's predictions would be of each process's own shard (its UNSUPPORTED row)."""
    vit = VisionTransformer(**MODELS[name])
    where = {n: tensor_plan.placement_of(n) for n, _ in vit.named_parameters()}
    assert [n for n, w in where.items() if w is None] == []
    refused = {tensor_plan.refused_feature(n) for n, w in where.items() if w == "refused"}
    refused |= set(tensor_plan.refused_options(vit.args))
    assert refused == ({"distillation token"} if name == "distillation token" else set())
    assert all(("tensor", feature) in UNSUPPORTED for feature in refused)
    assert set(tensor_plan.replicated_parameter_names(vit)) == {
        n for n, w in where.items() if w == "replicated"
    }


def test_a_parameter_the_tensor_plan_does_not_know_is_refused(monkeypatch):
    """A parameter a new option adds (a norm of the queries, a scale on a branch) and the plan
    does not name is refused before anything is split, naming it; so is a refused feature's."""
    vit = VisionTransformer(**SIZES)
    vit.blocks[0].attn.gate = nn.Linear(32, 32)
    vit.layer_scale = nn.Parameter(torch.ones(32))
    assert tensor_plan.placement_of("blocks.0.attn.gate.weight") is None
    with pytest.raises(
        ValueError, match="named layer_scale, blocks.0.attn.gate.weight, .*: declare"
    ):
        tensor_plan.parallelize_vit(vit, None)
    distilled = VisionTransformer(**MODELS["distillation token"])
    with pytest.raises(ValueError, match="cannot run the distillation token"):
        tensor_plan.parallelize_vit(distilled, None)
    # an option that changes what a parameter of the standard block's name holds is refused by
    # the model's arguments until the plan splits it (none is today)
    assert tensor_plan.REFUSED_OPTIONS == {}
    monkeypatch.setitem(tensor_plan.REFUSED_OPTIONS, "SwiGLU", lambda a: a.ffn != "mlp")
    packed = VisionTransformer(**SIZES, ffn="swiglu_packed")
    with pytest.raises(ValueError, match="cannot run the SwiGLU"):
        tensor_plan.parallelize_vit(packed, None)


# The first block's parameters each model's plan shards (the rest of the block replicated)
SPLIT = {
    "conv stem, registers, pre-norm, fc-norm, representation, local ffn": {
        f"blocks.0.{n}"
        for n in (
            "attn.qkv.weight",
            "attn.proj.weight",
            "ffn.fc1.weight",
            "ffn.fc1.bias",
            "ffn.dwconv.weight",
            "ffn.dwconv.bias",
            "ffn.fc2.weight",
        )  # fmt: skip
    },
    "block features: QK-norm, LayerScale, SwiGLU, RoPE, attention pool, RMSNorm": {
        f"blocks.0.{n}"
        for n in (
            "attn.qkv.weight",
            "attn.q_bias",
            "attn.v_bias",
            "attn.rope.freqs",
            "attn.proj.weight",
            "ffn.fc1_g.weight",
            "ffn.fc1_x.weight",
            "ffn.norm.weight",
            "ffn.fc2.weight",
        )
    },  # fmt: skip
    "parallel blocks, axial RoPE": {
        f"blocks.0.{n}" for n in ("in_proj.weight", "mlp_bias", "out_proj.weight")
    },
    "packed SwiGLU, DINOv3's RoPE": {
        f"blocks.0.{n}"
        for n in (
            "attn.qkv.weight",
            "attn.qkv.bias",
            "attn.proj.weight",
            "ffn.fc1.weight",
            "ffn.fc1.bias",
            "ffn.fc2.weight",
        )
    },  # fmt: skip
}


def test_the_plan_places_each_parameter_as_declared(tmp_path):
    """On a group of one process, each model but the distilled one is split: every parameter is
    a DTensor placed as its declaration says (parallelize_vit checks it), and the replicated ones
    are those the engine broadcasts; the partial-gradient ones (norms, LayerScales, QK-norms:
    the traffic estimate's) are among them, the hidden norm's (sharded) not."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        for name, kwargs in MODELS.items():
            if name == "distillation token":
                continue
            with torch.device("meta"):
                vit = VisionTransformer(**kwargs)
            tensor_plan.parallelize_vit(vit, mesh)
            params = dict(vit.named_parameters())
            shards = {n for n, p in params.items() if any(x.is_shard() for x in p.placements)}
            replicated = set(tensor_plan.replicated_parameter_names(vit))
            assert shards == set(params) - replicated, name
            partial = {id(p) for p in tensor_plan.partial_gradient_parameters(vit)}
            assert partial and partial <= {id(params[n]) for n in replicated}, name
            assert {n for n in params if n.startswith("blocks.0.")} & shards == SPLIT[name]
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", MODELS)
def test_the_pipeline_chunks_hold_every_parameter_once(name):
    """The embedding's parameters in the first chunk, the blocks' in theirs, the classifier's in
    the last: together each parameter once, and the chunks compute the model. A distilled
    model's token and head are in none, and the rule refuses the pipeline for it."""
    torch.manual_seed(0)
    vit = VisionTransformer(**MODELS[name]).eval()
    plan = parallel_plan(vit, "pipeline")
    first, last = (plan.chunk(r, i == 0, i == 1) for i, r in enumerate(plan.chunk_ranges(2)))
    held = [id(p) for chunk in (first, last) for p in chunk.parameters()]
    assert len(held) == len(set(held))
    missing = [n for n, p in vit.named_parameters() if id(p) not in set(held)]
    if vit.dist_token is not None:
        assert missing == ["dist_token", "head_dist.weight", "head_dist.bias"]
        assert ("pipeline", "distillation token") in UNSUPPORTED
        return
    assert missing == []
    images = torch.randn(2, vit.arch["in_channels"], 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(last(first(images)), vit(images), rtol=0, atol=0)


@pytest.mark.parametrize("centred", [True, False], ids=["layer", "rms"])
def test_the_hidden_norm_is_the_norm_of_the_whole_width(tmp_path, centred):
    """The hidden norm's hand-written statistics and gradients (tensor_layers.HiddenNorm) are
    F.layer_norm's and F.rms_norm's in float64, on a group of one process (the mesh tests split
    the width over 2 and 4). Checked to fail with the backward's mean of dy * weight left out of
    the LayerNorm's input gradient."""
    import torch.nn.functional as F

    from pycls.models.vit.tensor_layers import HiddenNorm

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = torch.distributed.group.WORLD
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, dtype=torch.float64, generator=gen).requires_grad_()
                   for s in ((3, 5, 12), (12,), (12,)))  # fmt: skip
        bias = b if centred else None
        ours = HiddenNorm.apply(x, w, bias, 1e-6, 12, group, centred)
        theirs = F.layer_norm(x, (12,), w, b, 1e-6) if centred else F.rms_norm(x, (12,), w, 1e-6)
        torch.testing.assert_close(ours, theirs)
        dy = torch.randn(ours.shape, dtype=torch.float64, generator=gen)
        wrt = (x, w, b) if centred else (x, w)
        for a, t in zip(torch.autograd.grad(ours, wrt, dy), torch.autograd.grad(theirs, wrt, dy)):
            torch.testing.assert_close(a, t)
    finally:
        torch.distributed.destroy_process_group()
