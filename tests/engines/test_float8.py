"""AMP.FLOAT8 on the CPU, as far as torchao allows without a GPU: the shape rule and the log,
the conversion against torchao's own, training (torch._scaled_mm has a CPU kernel, which the
launch check keeps runs from using: it is emulated), checkpoints that load into a bfloat16 model,
DDP and FSDP2 on 2 gloo processes (gloo moves no float8 tensors: FSDP2 gathers the weights in
their own type there, in float8 only over NCCL), compiled blocks, and the refusals."""

import logging
import os

import pytest
import torch

from pycls import config, distributed
from pycls.checkpoint import weight_files
from pycls.config import ConfigError
from pycls.core import builders, cli
from pycls.core.trainer import train_model
from pycls.distributed.preflight import check_float8
from pycls.engines import EngineSettings, float8, model_init_device, parallelize
from pycls.models import VisionTransformer
from tests.helpers import QUICKSTART, TINY, json_stats_of
from tests.helpers.distributed import batches, init_gloo, run_steps, spawn, tiny_cfg

torchao_float8 = pytest.importorskip("torchao.float8")
Float8Linear = torchao_float8.float8_linear.Float8Linear

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


def vit(**kw):
    """Widths 64 (attention) and 256 (MLP), 10 classes: the head's 10 is not a multiple of 16."""
    torch.manual_seed(0)
    args = dict(image_size=32, patch_size=8, depth=2, width=64, num_heads=2, mlp_dim=256)
    return VisionTransformer(**{**args, "num_classes": 10, "head_init_scale": 5.0, **kw})


def float8_layers(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


def test_shape_rule_leaves_small_layers_and_the_heads_and_says_so(caplog):
    model = vit(num_classes=32, dist_token=True)  # heads of 32 classes: a multiple of 16
    with caplog.at_level(logging.INFO, logger="pycls.engines.float8"):
        chosen = float8.convert(model, "tensorwise", min_dim=128)
    # fc1 (64 -> 256) and fc2 (256 -> 64) have a side of 64 < 128; nothing converts
    assert chosen == [] and float8_layers(model) == []
    assert "0 of 10 linear layers in float8; kept as they were: 2 x 64->64, 2 x 64->192, " in (
        caplog.text
    )
    assert "(a side below AMP.FLOAT8_MIN_DIM 128); 2 x 64->32 (a head)" in caplog.text
    assert "converts no layer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pycls.engines.float8"):
        chosen = float8.convert(model, "tensorwise", min_dim=64)
    blocks = [f"blocks.{i}.{layer}" for i in range(2)
              for layer in ("attn.qkv", "attn.proj", "ffn.fc1", "ffn.fc2")]  # fmt: skip
    assert sorted(chosen) == float8_layers(model) == sorted(blocks)  # never head, head_dist
    assert (
        "8 of 10 linear layers in float8: blocks 0-1: attn.qkv, attn.proj, ffn.fc1, ffn.fc2 "
        "(2 x 64->64, 2 x 64->192, 2 x 64->256, 2 x 256->64); kept as they were: 2 x 64->32 "
        "(a head)"
    ) in caplog.text
    assert float8.eligible(torch.nn.Linear(2048, 4096), "blocks.0.ffn.fc1", 2048)
    assert float8.why_kept(torch.nn.Linear(2048, 1024), "blocks.0.ffn.fc2", 2048) == (
        "a side below AMP.FLOAT8_MIN_DIM 2048"
    )
    assert float8.why_kept(torch.nn.Linear(2056, 2048), "x", 0) == "a side not a multiple of 16"
    assert float8.why_kept(torch.nn.Linear(4096, 4096), "head", 0) == "a head"


# The shipped recipes' sizes: (spec, per-process batch of configs/vit_*.yaml on one GPU)
RECIPE_SHAPES = {"vit_b16": 256, "vit_l16": 128, "vit_h14": 64}
PARTS = ("attn.qkv", "attn.proj", "ffn.fc1", "ffn.fc2")


def _named(depth, parts):
    return [f"blocks.{i}.{part}" for i in range(depth) for part in parts]


@pytest.mark.parametrize("arch", list(RECIPE_SHAPES))
def test_float8_layers_choose_among_what_the_shape_rule_allows(arch):
    """AMP.FLOAT8_LAYERS on ViT-B/16, ViT-L/16 and ViT-H/14 (built on the meta device, with
    their recipes' batch of 224 px images): FLOAT8_MIN_DIM filters first (its default 2048 leaves
    no layer of theirs, whatever FLOAT8_LAYERS says: what ran before the key); at 0, "all" takes
    every block layer, "mlp" fc1 and fc2, "auto" the roofline's choice: nothing for ViT-B (every
    layer's casts outweigh its gain), qkv, fc1 and fc2 for ViT-L and ViT-H (never the square
    proj, whose input is the attention kernel's). A micro-batch of one image: nothing (the
    weight's casts, paid per step, outweigh the gain of 197-257 rows)."""
    from pycls.models import VIT_SPECS

    with torch.device("meta"):
        model = VisionTransformer(image_size=224, num_classes=1000, **VIT_SPECS[arch])
    depth = VIT_SPECS[arch]["depth"]
    rows = RECIPE_SHAPES[arch] * float8.tokens_per_image(model)
    assert float8.tokens_per_image(model) == {"vit_h14": 257}.get(arch, 197)
    for layers in float8.LAYER_CHOICES:
        assert float8.chosen_layers(model, 2048, layers, rows) == [], layers
    assert float8.chosen_layers(model, 0, "all", rows) == _named(depth, PARTS)
    assert float8.chosen_layers(model, 0, "mlp", rows) == _named(depth, ("ffn.fc1", "ffn.fc2"))
    want = [] if arch == "vit_b16" else _named(depth, ("attn.qkv", "ffn.fc1", "ffn.fc2"))
    assert float8.chosen_layers(model, 0, "auto", rows) == want
    assert float8.chosen_layers(model, 0, "auto", float8.tokens_per_image(model)) == []
    reason = float8.why_kept(model.blocks[0].attn.proj, "blocks.0.attn.proj", 0, "auto", rows)
    assert reason == f"casts outweigh the float8 matmul at {rows} rows (AMP.FLOAT8_LAYERS auto)"


# The block features' matrices in ViT-L/16 (batch 128 at 224 px): a block's layers, those
# AMP.FLOAT8_LAYERS mlp takes, and those auto takes (the roofline's gain of each, as a fraction of
# its bfloat16 matmul time: SwiGLU's 1024->2752 matrices +2.9 %, its packed 1024->5504 +7.7 %; the
# parallel block's in_proj 1024->7168 +8.8 %, out_proj 5120->1024 -1.2 %: the attention output's
# extra read sinks it, as it sinks proj's -22 %)
FEATURE_LAYERS = {
    "swiglu": (
        dict(ffn="swiglu", ffn_width="two_thirds", ffn_align=64),
        ("attn.qkv", "attn.proj", "ffn.fc1_g", "ffn.fc1_x", "ffn.fc2"),
        ("ffn.fc1_g", "ffn.fc1_x", "ffn.fc2"),
        ("attn.qkv", "ffn.fc1_g", "ffn.fc1_x", "ffn.fc2"),
    ),
    "swiglu_packed": (
        dict(ffn="swiglu_packed", ffn_width="two_thirds", ffn_align=64),
        PARTS,
        ("ffn.fc1", "ffn.fc2"),
        ("attn.qkv", "ffn.fc1", "ffn.fc2"),
    ),
    "parallel": (
        dict(block="parallel"),
        ("in_proj", "out_proj"),
        ("in_proj", "out_proj"),
        ("in_proj",),
    ),  # fmt: skip
}


@pytest.mark.parametrize("kind", list(FEATURE_LAYERS))
def test_float8_layers_cover_the_swiglu_and_fused_matrices(kind):
    """AMP.FLOAT8_LAYERS mlp takes a SwiGLU's gate and value projections (fc1_g, fc1_x) or its
    packed fc1, and the parallel block's fused in_proj and out_proj (its MLP's matrices); auto
    weighs each by its shape, out_proj's input read once more for its scale (the attention's
    output in it). Checked to fail with MLP_LAYERS fc1 and fc2 only (mlp then took nothing of
    the parallel block and fc2 alone of the SwiGLU) and with out_proj not after the attention
    (auto took it, at +7.3 %). Converted on the CPU, a tiny model's chosen layers are torchao's
    float8 layers and train."""
    from pycls.models import VIT_SPECS

    kwargs, every, mlp, auto = FEATURE_LAYERS[kind]
    with torch.device("meta"):
        model = VisionTransformer(image_size=224, num_classes=1000, **VIT_SPECS["vit_l16"],
                                  **kwargs)  # fmt: skip
    rows = 128 * float8.tokens_per_image(model)
    for layers, want in (("all", every), ("mlp", mlp), ("auto", auto)):
        assert float8.chosen_layers(model, 0, layers, rows) == _named(24, want), layers
    tiny = vit(**kwargs)
    chosen = float8.convert(tiny, "tensorwise", min_dim=0, layers="mlp")
    assert float8_layers(tiny) == sorted(chosen) == sorted(_named(2, mlp))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tiny(torch.randn(2, 3, 32, 32)).float().sum().backward()
    assert all(p.grad is not None for p in tiny.parameters())


def test_the_roofline_of_auto():
    """float8_gain against the arithmetic written out: a 4096 x 4096 layer at 16384 rows gains
    about a quarter of its bfloat16 matmuls' time (float8's 1.65x alone would save 39 %); the
    weight's casts alone sink it at 16 rows; the attention kernel's output costs proj one more
    read."""
    m, k = 16384, 4096
    bf16 = 6 * m * k * k / float8.BF16_MATMUL_FLOPS
    fp8 = 6 * m * k * k / float8.FLOAT8_MATMUL_FLOPS
    casts = (6 * m * 2 * k + 6 * k * k) / float8.CAST_BYTES_PER_SECOND
    assert float8.float8_gain(k, k, m) == pytest.approx(bf16 - fp8 - casts)
    assert 0.2 < float8.float8_gain(k, k, m) / bf16 < 0.3
    assert float8.float8_gain(k, k, 16) < 0
    extra = 2 * m * k / float8.CAST_BYTES_PER_SECOND
    assert float8.float8_gain(k, k, m, after_attention=True) == pytest.approx(
        float8.float8_gain(k, k, m) - extra
    )


def test_the_engine_converts_what_float8_layers_picks(caplog):
    """parallelize passes AMP.FLOAT8_LAYERS and the rows of one micro-batch (its images x the
    model's tokens) to the conversion."""
    settings = EngineSettings(float8="tensorwise", float8_min_dim=0, float8_layers="mlp")
    model = parallelize(vit(), settings).model
    assert float8_layers(model) == _named(2, ("ffn.fc1", "ffn.fc2"))
    settings = EngineSettings(float8="tensorwise", float8_min_dim=0, float8_layers="auto",
                              float8_micro_batch=8)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="pycls.engines.float8"):
        model = parallelize(vit(), settings).model
    assert float8_layers(model) == []  # widths of 64-256: too small to gain
    assert "at 136 rows (AMP.FLOAT8_LAYERS auto)" in caplog.text  # 8 images x 17 tokens
    cfg = config.load_cfg(None, [*TINY, "AMP.FLOAT8", "tensorwise", "AMP.FLOAT8_LAYERS", "auto",
                                 "TRAIN.ACCUM_STEPS", "2"])  # fmt: skip
    assert builders.engine_settings(cfg).float8_micro_batch == 32  # 64 images in 2 micro-batches
    with pytest.raises(ConfigError, match=r"^AMP\.FLOAT8_LAYERS: mlp picks among"):
        config.load_cfg(None, ["AMP.FLOAT8_LAYERS", "mlp"])


def _cpu_rowwise_matmuls():
    """Whether this torch multiplies float8 with per-row scales on the CPU (torch 2.10's
    emulation takes per-tensor scales only; runs are refused on the CPU anyway, the tests
    emulate)."""
    a = torch.randn(16, 16).to(torch.float8_e4m3fn)
    b = torch.randn(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)  # fmt: skip
    except RuntimeError:
        return False
    return True


CPU_ROWWISE = _cpu_rowwise_matmuls()
NO_CPU_ROWWISE = "this torch's CPU float8 matmul takes per-tensor scales only (torch 2.10)"


@pytest.mark.parametrize(
    "recipe",
    [
        "tensorwise",
        pytest.param("rowwise", marks=pytest.mark.skipif(not CPU_ROWWISE, reason=NO_CPU_ROWWISE)),
    ],
)
def test_conversion_is_torchaos_own(recipe):
    """The converted model computes what torchao's conversion of the same layers computes."""
    ours, theirs = vit(), vit()
    chosen = float8.convert(ours, recipe, min_dim=0)
    config_ = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    torchao_float8.convert_to_float8_training(
        theirs, config=config_, module_filter_fn=lambda m, n: n in chosen
    )
    assert float8_layers(ours) == float8_layers(theirs) == sorted(chosen)
    x = torch.randn(4, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(x), theirs(x)
    assert torch.equal(a, b)
    a.float().sum().backward()
    b.float().sum().backward()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad)
    # float8 computes close to bfloat16, not equal to it: e4m3 keeps 3 mantissa bits (a relative
    # 6 % per value), which the sums over 64-256 products average down
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = vit()(x).float()
    error = (a.float() - plain).norm() / plain.norm()
    assert 0 < error < 0.1, error


def test_trained_weights_load_into_a_bfloat16_model(tmp_path):
    """A float8 run's checkpoint holds plain weights under the same names: a model without
    float8, in bfloat16, loads and evaluates them."""
    f8 = ["AMP.FLOAT8", "tensorwise", "AMP.FLOAT8_MIN_DIM", "0", "AMP.LEVEL", "O1"]
    cfg = config.load_cfg(QUICKSTART, [*TINY, "OUT_DIR", str(tmp_path), "OPTIM.MAX_EPOCH", "1",
                                       "TRAIN.EVAL_PERIOD", "1", *f8])  # fmt: skip
    stats = train_model(cfg)
    assert stats["top1_err"] < 90
    state = weight_files.read_weights(str(tmp_path / "model_final.safetensors"))
    model = builders.build_model(cfg)
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state)
    model = model.to(torch.bfloat16).eval()
    assert model(torch.randn(2, 3, 16, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert json_stats_of(tmp_path, "train_epoch")


def test_refused_without_float8_matmuls_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"AMP\.FLOAT8: tensorwise needs float8 matmuls.*the CPU"):
        check_float8("tensorwise", "cpu")
    check_float8("none", "cpu")
    argv = ["--mode", "train", "--cfg", QUICKSTART, "AMP.FLOAT8", "rowwise", "DEVICE", "cpu",
            "OUT_DIR", str(tmp_path / "run")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "config error: AMP.FLOAT8: rowwise needs float8 matmuls"
    ), err
    assert not os.path.exists(tmp_path / "run")
    refused = (
        ["TRAIN.PARALLEL", "pipeline"],
        ["TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale"],
        ["TRAIN.PARALLEL", "tensor"],
    )
    for overrides in refused:
        with pytest.raises(ConfigError, match="AMP.FLOAT8: cannot be used with"):
            config.load_cfg(None, ["AMP.FLOAT8", "tensorwise", *overrides])


@pytest.mark.slow
def test_compiled_blocks_compute_what_eager_ones_do():
    settings = EngineSettings(float8="tensorwise", float8_min_dim=0, compile=True)
    eager = parallelize(vit(), EngineSettings(float8="tensorwise", float8_min_dim=0))
    compiled = parallelize(vit(), settings)
    compiled.compile()
    x = torch.randn(4, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = eager.step_model(x), compiled.step_model(x)
    assert float8_layers(compiled.module) == float8_layers(eager.module) != []
    # inductor fuses the casts and the scales' arithmetic: a value near a float8 rounding boundary
    # can round the other way, so the two agree to float8's noise, not bit for bit
    error = (a.float() - b.float()).norm() / a.float().norm()
    assert error < 0.02, error


# ------------------------------------------------------------------------------------------------ #
# DDP and FSDP2 on 2 gloo processes
# ------------------------------------------------------------------------------------------------ #

F8 = ["AMP.FLOAT8", "tensorwise", "AMP.FLOAT8_MIN_DIM", "0", "AMP.LEVEL", "O1"]
ENGINES = {
    "ddp": ["TRAIN.PARALLEL", "ddp"],
    "fsdp": ["TRAIN.PARALLEL", "fsdp"],
    "fsdp_rowwise": ["TRAIN.PARALLEL", "fsdp", "AMP.FLOAT8", "rowwise"],
}
if not CPU_ROWWISE:  # NO_CPU_ROWWISE: the rowwise case cannot be emulated here
    del ENGINES["fsdp_rowwise"]
# Each process scales its own half of the batch's activations to float8 (e4m3: 3 mantissa bits),
# so 2 processes round other values than one: the losses of 5 steps agree to float8's noise,
# which is also how far float8 is from bfloat16 here (0.15 %, measured)
LOSS_RTOL = 5e-3


def _float8_worker(rank, world, port, out_dir):
    init_gloo(rank, world, port)
    try:
        results = {}
        for name, overrides in ENGINES.items():
            engine, _, losses = run_steps(
                tiny_cfg(*F8, *overrides), batches(tiny_cfg()), rank, world
            )
            results[name] = {"losses": losses, "float8": float8_layers(engine.module)}
        results["gathered_in_float8"] = _float8_all_gather_shards(rank)
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "float8.pt"))
    finally:
        distributed.destroy_process_group()


def _float8_all_gather_shards(rank):
    """FSDP2 over weights set up for the float8 all-gather (torchao's tensor subclass, as on a
    GPU): (the local shard's type, the names whose gathered weights differ from rank 0's)."""
    cfg = tiny_cfg("TRAIN.PARALLEL", "fsdp")
    settings = builders.engine_settings(cfg)
    torch.manual_seed(0)
    with model_init_device(settings):
        model = builders.build_model(cfg)
    start = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else {}
    float8.convert(model, "tensorwise", 0, fsdp_all_gather=True)
    engine = parallelize(model, settings, "cpu", builders.build_precision(cfg, "cpu"))
    kind = type(engine.module.blocks[0].attn.qkv.weight.to_local()).__name__
    full = engine.full_state_dict()
    return kind, [k for k in start if not torch.equal(start[k], full[k])]


@pytest.mark.slow
def test_ddp_and_fsdp_train_float8_layers_as_one_process_does(tmp_path):
    spawn(_float8_worker, 2, str(tmp_path))
    got = torch.load(str(tmp_path / "float8.pt"), weights_only=False)
    for name, overrides in ENGINES.items():
        engine, _, losses = run_steps(tiny_cfg(*F8, *overrides[2:]), batches(tiny_cfg()))
        assert got[name]["float8"] == float8_layers(engine.module) != [], name
        torch.testing.assert_close(
            torch.tensor(got[name]["losses"]), torch.tensor(losses), rtol=LOSS_RTOL, atol=0
        )
    # FSDP2 shards and fills the weights of the float8 all-gather (only NCCL can then gather
    # them in float8: gloo moves no float8 tensor)
    assert got["gathered_in_float8"] == ("WeightWithDynamicFloat8CastTensor", [])
    # and float8 trains: its losses fall as bfloat16's do
    _, _, bf16 = run_steps(tiny_cfg("AMP.LEVEL", "O1"), batches(tiny_cfg()))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(bf16), rtol=LOSS_RTOL, atol=0)
