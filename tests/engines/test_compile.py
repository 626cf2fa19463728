"""TRAIN.COMPILE: regional compilation (each repeated block compiled in place) against eager
execution, the blocks each model family names, and the engine rule for the whole-model scope."""

import pytest
import torch

from pycls import config
from pycls.core import cli
from pycls.core.builders import engine_settings
from pycls.engines.base import compile_kwargs, compile_model
from pycls.errors import ConfigError
from pycls.models import AnyNet, ResNet, VisionTransformer, effnet, resnet
from tests.helpers import json_stats_of, tiny_quickstart, tiny_vit

TORCH_VERSION = tuple(int(v) for v in torch.__version__.split(".")[:2])

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


def test_repeated_blocks_are_every_block_in_order():
    vit = tiny_vit()
    assert vit.repeated_blocks() == list(vit.blocks)
    for net in (resnet("50"), ResNet(depth=50)):  # the zoo's (an AnyNet) and the family's
        blocks = net.repeated_blocks()
        assert len(blocks) == 3 + 4 + 6 + 3
        assert blocks[0] is net.s1.b1 and blocks[-1] is net.s4.b3
    anynet = AnyNet(stem_type="res_stem_cifar", stem_w=8, block_type="res_basic_block",
                    depths=[1, 2], widths=[8, 16], strides=[1, 2], num_classes=10)  # fmt: skip
    assert len(anynet.repeated_blocks()) == 3
    en = effnet("B0")
    assert len(en.repeated_blocks()) == sum(len(list(s.children())) for s in _stages(en))


def _stages(model):
    return [m for name, m in model.named_children() if name[0] == "s" and name[1:].isdigit()]


@pytest.mark.slow
def test_regional_compile_matches_eager():
    eager, compiled = tiny_vit(), tiny_vit()  # the same seed: the same weights
    assert compile_model(compiled, "blocks") is compiled
    assert all(b._compiled_call_impl is not None for b in compiled.blocks)
    assert compiled._compiled_call_impl is None  # the embedding and head stay eager
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 3, 5, 9])
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits, y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[name] = logits.detach(), grads
    torch.testing.assert_close(out["compiled"][0], out["eager"][0], rtol=1e-5, atol=1e-5)
    for n, g in out["eager"][1].items():
        torch.testing.assert_close(out["compiled"][1][n], g, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.slow
def test_blocks_of_rising_drop_path_rates_share_one_graph():
    """Stochastic depth rises block by block; the GPU profile of ViT-B/16 showed 4 of its 12
    blocks uncompiled, because each rate was compiled apart and the 9th hit dynamo's recompile
    limit (8). With inductor, torch 2.10 compiled one graph per rate (12) while the rate was a
    Python float; as a tensor, the blocks with a rate share one graph on every torch (the first,
    rate 0, has its own)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = VisionTransformer(image_size=16, patch_size=8, depth=12, width=16, num_heads=2,
                              mlp_dim=32, num_classes=4, drop_path=0.1)  # fmt: skip
    rates = [b.drop_path.p for b in model.blocks]
    assert rates[0] == 0 and len(set(rates)) == 12
    compile_model(model, "blocks")
    model.train()(torch.randn(2, 3, 16, 16)).sum().backward()
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]
    # Every block ran compiled: no frame fell back to eager (the limit is raised to the blocks)
    assert frames["total"] == frames["ok"], dict(frames)
    assert torch._dynamo.config.recompile_limit >= len(model.blocks) + 2
    assert graphs <= 2 and frames["total"] <= 2, dict(counters["stats"])


@pytest.mark.slow
def test_regional_compile_under_fsdp2_trains_as_eager(tmp_path, warm_num_procs):
    """FSDP2's hooks stay outside the compiled blocks: two processes train as in eager mode."""
    losses = {}
    for name, on in (("eager", "False"), ("compiled", "True")):
        out = tmp_path / name
        cfg = tiny_quickstart(out, "OPTIM.MAX_EPOCH", "1", "TRAIN.PARALLEL", "fsdp",
                              "NUM_PROCS", "2", "TRAIN.COMPILE", on)  # fmt: skip
        with open(tmp_path / f"{name}.yaml", "w") as f:
            f.write(cfg.dump())
        assert cli.main(["--mode", "train", "--cfg", str(tmp_path / f"{name}.yaml")]) == 0
        losses[name] = [s["loss"] for s in json_stats_of(out, "train_iter")]
    assert len(losses["eager"]) >= 2
    torch.testing.assert_close(
        torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=0
    )


def test_compile_under_fairscale_is_refused_naming_both_keys():
    overrides = ["TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale", "TRAIN.COMPILE", "True"]
    with pytest.raises(ConfigError, match=r"TRAIN\.COMPILE.*FSDP\.BACKEND fairscale"):
        config.load_cfg(None, overrides)


def test_whole_model_compile_is_refused_under_the_pipeline():
    overrides = ["TRAIN.PARALLEL", "pipeline", "TRAIN.COMPILE", "True"]
    assert config.load_cfg(None, overrides).TRAIN.COMPILE_SCOPE == "blocks"  # the default works
    with pytest.raises(ConfigError, match=r"TRAIN\.PARALLEL pipeline.*TRAIN\.COMPILE_SCOPE"):
        config.load_cfg(None, [*overrides, "TRAIN.COMPILE_SCOPE", "model"])
    with pytest.raises(ConfigError, match=r"TRAIN\.COMPILE_SCOPE"):
        config.load_cfg(None, ["TRAIN.COMPILE_SCOPE", "layers"])


def test_compile_mode_and_coordinate_descent_reach_every_compile():
    """The defaults keep torch's own compile (no argument at all); a mode goes as a mode, and
    the tuning as the mode's options plus it (torch.compile takes one or the other); every
    block and the whole model get them."""
    assert compile_kwargs() == {}
    assert compile_kwargs("max-autotune-no-cudagraphs") == {"mode": "max-autotune-no-cudagraphs"}
    assert compile_kwargs(coordinate_descent=True) == {
        "options": {"coordinate_descent_tuning": True}
    }
    tuned = compile_kwargs("reduce-overhead", True)["options"]
    assert tuned == {**torch._inductor.list_mode_options("reduce-overhead"),
                     "coordinate_descent_tuning": True}  # fmt: skip
    seen = []

    class Block(torch.nn.Module):
        def compile(self, **kwargs):
            seen.append(kwargs)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def repeated_blocks(self):
            return list(self.blocks)

    compile_model(Net(), "blocks", mode="max-autotune")
    assert seen == [{"backend": "inductor", "mode": "max-autotune"}] * 2
    cfg = config.load_cfg(None, ["TRAIN.COMPILE", "True", "TRAIN.COMPILE_MODE", "max-autotune",
                                 "TRAIN.COMPILE_COORDINATE_DESCENT", "True"])  # fmt: skip
    s = engine_settings(cfg)
    assert (s.compile_mode, s.compile_coordinate_descent) == ("max-autotune", True)


@pytest.mark.parametrize("key, value", [("TRAIN.COMPILE_MODE", "max-autotune"),
                                        ("TRAIN.COMPILE_COORDINATE_DESCENT", "True")])  # fmt: skip
def test_compile_options_are_refused_without_compile(key, value):
    with pytest.raises(ConfigError, match=f"{key}: .*TRAIN.COMPILE is False"):
        config.load_cfg(None, [key, value])


def _block_graphs(model, specialize_float):
    """(graphs dynamo made, blocks that ran through one) of a training step and an evaluation
    of ``model`` with every block compiled, on a backend that counts (a second each)."""
    graphs, calls = [], []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            calls.append(len(graphs))
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=specialize_float):
        compile_model(model, "blocks", backend=counting_backend)
        model.train()(torch.randn(2, 3, 16, 16)).sum().backward()
        model(torch.randn(2, 3, 16, 16))  # a second step reuses the graphs
    torch._dynamo.reset()
    return len(graphs), len(calls)


def test_blocks_share_one_graph_even_where_dynamo_specialises_floats():
    """Where a module's Python float is specialised (torch 2.10 under inductor; forced here with
    ``specialize_float``, on every torch and backend), a rate read as a float gives one graph per
    rate (12 for ViT-B). The rate lives in a tensor: at most two graphs (the first block, rate 0,
    has its own), and every block runs through one of them. A counting backend keeps the test to
    a second."""
    model = VisionTransformer(image_size=16, patch_size=8, depth=6, width=16, num_heads=2,
                              mlp_dim=32, num_classes=4, drop_path=0.1)  # fmt: skip
    assert len({b.drop_path.p for b in model.blocks}) == 6
    graphs, calls = _block_graphs(model, specialize_float=True)
    assert graphs <= 2, f"{graphs} graphs for 6 blocks"
    assert calls == 2 * len(model.blocks), "a block ran outside the compiled graphs"


# The block features, each variant several at once: the parallel block with RMSNorm, QK-norm,
# LayerScale, an axial RoPE and the attention pool, bias-free; a packed SwiGLU with its hidden
# norm, EVA's q and v biases, a mixed RoPE (learned per-head frequencies) and no position table;
# a SwiGLU of two projections with DINOv3's RoPE
BLOCK_FEATURES = {
    "parallel": dict(block="parallel", norm_layer="rms", qk_norm="rms", layer_scale_init=1e-5,
                     rope="axial", classifier="map", qkv_bias=False, proj_bias=False),
    "swiglu_packed": dict(ffn="swiglu_packed", ffn_norm=True, key_bias=False, rope="mixed",
                          qk_norm="layer", layer_scale_init=1e-5, pos_embed="none"),
    "swiglu": dict(ffn="swiglu", ffn_width="two_thirds", rope="dinov3", rope_layout="half"),
}  # fmt: skip


@pytest.mark.parametrize("specialize_float", [False, True], ids=["floats", "specialised"])
@pytest.mark.parametrize("features", list(BLOCK_FEATURES))
def test_every_block_variant_compiles_to_at_most_two_graphs(features, specialize_float):
    """Each block variant, its drop-path rates rising over 6 blocks: at most two graphs (the
    first block's rate 0 has its own), every block through one of them, with dynamo's floats as
    they are and specialised (torch 2.10's). The RoPE positions enter every block as a tensor,
    made once per forward, and the LayerScale's initial value and the rotation's temperature are
    the same in every block: nothing of theirs tells two blocks apart. Checked to fail (every
    case) with a number of each block's own that the rotation reads, a Python int or float
    attribute of its Rotary (one graph per block)."""
    model = VisionTransformer(image_size=16, patch_size=4, depth=6, width=16, num_heads=2,
                              mlp_dim=32, num_classes=4, drop_path=0.1,
                              **BLOCK_FEATURES[features])  # fmt: skip
    assert len({b.drop_path.p for b in model.blocks}) == 6
    graphs, calls = _block_graphs(model, specialize_float)
    assert graphs <= 2, f"{graphs} graphs for 6 blocks"
    assert calls == 2 * len(model.blocks), "a block ran outside the compiled graphs"
