"""Muon (OPTIM.OPTIMIZER muon): its matrices against torch.optim.Muon, the rest against
torch.optim.AdamW, over 100 steps; the parameter groups of a ViT; state dicts and resume; DDP,
FSDP2, the pipeline and tensor parallelism on 2 gloo processes against one process, and FSDP2's
sharded checkpoint resumed in one."""

import copy
import inspect
import io
import os
import zlib

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pycls import config, distributed
from pycls.checkpoint import sharded, weight_files
from pycls.config import ConfigError
from pycls.core import builders
from pycls.core.trainer import train_model
from pycls.optim import Muon, OptimizerSettings, optimizer_from_settings, param_groups
from pycls.optim.muon import orthogonalize
from tests.helpers import ROOT, TINY, json_stats_of, resume_from, tiny_vit
from tests.helpers.distributed import (
    LOSS_RTOL,
    assert_weights_close,
    batches,
    build,
    init_gloo,
    run_steps,
    spawn,
    tiny_cfg,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

STEPS = 100
# Tall, wide and square matrices, and a bias-like vector and a 3-d tensor for AdamW
MATRICES = [(12, 5), (5, 12), (8, 8)]
OTHERS = [(7,), (3, 2, 2)]


def tensors(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def grads(shapes, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    return [torch.randn(s, generator=gen) for s in shapes]


def run(optimizers, params, shapes, start, stop):
    for step in range(start, stop):
        for p, g in zip(params, grads(shapes, step)):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)  # in place: the contiguous mode's views must survive
        for opt in optimizers:
            opt.step()


MUON_CASES = {
    "nesterov_rms": dict(nesterov=True, adjust_lr="match_rms_adamw"),
    "nesterov_original": dict(nesterov=True, adjust_lr="original"),
    "plain_momentum": dict(nesterov=False, adjust_lr="match_rms_adamw"),
}


def ours_and_torch(case, contiguous=False):
    """pycls's Muon over one Muon group and one AdamW group, and torch.optim's Muon and AdamW
    over copies of the same tensors."""
    kwargs = MUON_CASES[case]
    mats, others = tensors(MATRICES, 0), tensors(OTHERS, 1)
    ours = Muon(
        [
            {"params": mats, "use_muon": True, "lr": 0.02, "weight_decay": 0.1},
            {"params": others, "lr": 0.003, "weight_decay": 0.05},
        ],
        momentum=0.9,
        contiguous=contiguous,
        **kwargs,
    )
    tm, to = [copy.deepcopy(p) for p in mats], [copy.deepcopy(p) for p in others]
    adjust = kwargs["adjust_lr"]
    # torch releases whose Muon offers use_addmm (off by default) iterate without addmm unless
    # asked; pycls, and the later releases always, use addmm: the same sums, rounded alike
    addmm = "use_addmm" in inspect.signature(torch.optim.Muon).parameters
    theirs = [
        torch.optim.Muon(
            tm,
            **({"use_addmm": True} if addmm else {}),
            lr=0.02,
            weight_decay=0.1,
            momentum=0.9,
            nesterov=kwargs["nesterov"],
            adjust_lr_fn=adjust,
        ),  # fmt: skip
        torch.optim.AdamW(to, lr=0.003, weight_decay=0.05, foreach=False),
    ]
    return ours, mats + others, theirs, tm + to


@pytest.mark.parametrize("case", sorted(MUON_CASES))
def test_matches_torch_optim_muon_and_adamw_over_100_steps(case):
    ours, params, theirs, reference = ours_and_torch(case)
    run([ours], params, MATRICES + OTHERS, 0, STEPS)
    run(theirs, reference, MATRICES + OTHERS, 0, STEPS)
    for a, b in zip(params[: len(MATRICES)], reference):  # the same operations, in order
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(params[len(MATRICES) :], reference[len(MATRICES) :]):  # fused vs plain AdamW
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_contiguous_buffers_step_as_separate_tensors():
    per_tensor, params, _, _ = ours_and_torch("nesterov_rms")
    contiguous, flat_params, _, _ = ours_and_torch("nesterov_rms", contiguous=True)
    run([per_tensor], params, MATRICES + OTHERS, 0, 20)
    run([contiguous], flat_params, MATRICES + OTHERS, 0, 20)
    for a, b in zip(flat_params[: len(MATRICES)], params):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(flat_params[len(MATRICES) :], params[len(MATRICES) :]):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_orthogonalize_gives_singular_values_near_one():
    matrix = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    singular = torch.linalg.svdvals(orthogonalize(matrix).float())
    # Keller Jordan's coefficients trade exactness for speed: singular values in about [0.5, 1.5]
    assert singular.min() > 0.5 and singular.max() < 1.5, singular


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_resume_is_exact():
    full, full_params, _, _ = ours_and_torch("nesterov_rms")
    run([full], full_params, MATRICES + OTHERS, 0, 40)
    first, first_params, _, _ = ours_and_torch("nesterov_rms")
    run([first], first_params, MATRICES + OTHERS, 0, 20)
    saved = _round_trip({"params": [p.detach() for p in first_params], "opt": first.state_dict()})
    assert "momentum_buffer" in saved["opt"]["state"][0] and "exp_avg" in saved["opt"]["state"][3]
    second, second_params, _, _ = ours_and_torch("nesterov_rms", contiguous=True)
    with torch.no_grad():
        for p, t in zip(second_params, saved["params"]):
            p.copy_(t)
    second.load_state_dict(saved["opt"])
    run([second], second_params, MATRICES + OTHERS, 20, 40)
    for a, b in zip(second_params[: len(MATRICES)], full_params):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(second_params[len(MATRICES) :], full_params[len(MATRICES) :]):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_refuses_a_muon_group_that_is_not_2d():
    with pytest.raises(ValueError, match="not 2-D"):
        Muon([{"params": tensors([(3, 2, 2)], 0), "use_muon": True}])


# ------------------------------------------------------------------------------------------------ #
# Parameter groups and the config
# ------------------------------------------------------------------------------------------------ #


def test_vit_groups_put_the_blocks_matrices_on_muon_and_the_rest_on_adamw():
    model = tiny_vit()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, 0.05, muon_weight_decay=0.1, muon_lr_mult=2.0)
    by_name = {g["name"]: g for g in groups}
    assert list(by_name) == ["decay", "no_decay", "muon"]
    muon = {names[id(p)] for p in by_name["muon"]["params"]}
    per_block = {"attn.qkv.weight", "attn.proj.weight", "ffn.fc1.weight", "ffn.fc2.weight"}
    assert muon == {f"blocks.{i}.{w}" for i in range(2) for w in per_block}
    assert by_name["muon"]["use_muon"] and by_name["muon"]["weight_decay"] == 0.1
    assert by_name["muon"]["lr_scale"] == 2.0
    adamw = {names[id(p)] for p in by_name["decay"]["params"]}
    assert adamw == {"patch_embed.proj.weight", "head.weight"}
    no_decay = {names[id(p)] for p in by_name["no_decay"]["params"]}
    assert {"pos_embed", "class_token"} <= no_decay and all(
        n.endswith((".bias", "_token", "pos_embed")) or "ln_" in n or n.startswith("norm.")
        for n in no_decay
    )
    # With layer decay, each layer's matrices form a Muon group of that layer
    layered = param_groups(model, 0.05, layer_decay=0.5, depth=2, muon_weight_decay=0.1)
    muon_groups = [g for g in layered if g.get("use_muon")]
    assert [g["name"] for g in muon_groups] == ["layer1_muon", "layer2_muon"]
    assert [g["lr_scale"] for g in muon_groups] == [0.25, 0.5]


def test_built_from_the_config_and_refused_for_cnns_and_fairscale(tmp_path):
    cfg = config.load_cfg(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        [*TINY, "OPTIM.OPTIMIZER", "muon", "MUON.LR_MULT", "0.5", "MUON.WEIGHT_DECAY", "0.01"],
    )
    opt = builders.build_optimizer(cfg, builders.build_model(cfg))
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert isinstance(opt, Muon) and len(muon) == 1
    assert muon[0]["lr"] == 0.5 * cfg.OPTIM.BASE_LR and muon[0]["weight_decay"] == 0.01
    assert muon[0]["momentum"] == 0.95 and muon[0]["adjust_lr"] == "match_rms_adamw"
    with pytest.raises(ConfigError, match="OPTIM.OPTIMIZER: muon .* convolution kernel"):
        config.load_cfg(
            os.path.join(ROOT, "configs", "quickstart_regnet.yaml"), ["OPTIM.OPTIMIZER", "muon"]
        )
    with pytest.raises(ConfigError, match="OPTIM.OPTIMIZER: cannot be used with .*fairscale"):
        config.load_cfg(
            None,
            ["OPTIM.OPTIMIZER", "muon", "TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale"],
        )
    with pytest.raises(ValueError, match="no hidden 2-D weights"):
        optimizer_from_settings(torch.nn.Linear(3, 3), OptimizerSettings(name="muon"))


def test_training_resumes_exactly(tmp_path):
    """Two epochs in one go, and the same run resumed from its epoch-1 checkpoint: the same
    weights, bit for bit (Muon's momentum and AdamW's moments both restored)."""
    common = [*TINY, "OPTIM.OPTIMIZER", "muon", "OPTIM.MAX_EPOCH", "2", "TRAIN.EVAL_PERIOD", "2"]
    common += ["TRAIN.CHECKPOINT_PERIOD", "1", "OPTIM.CONTIGUOUS_PARAMS", "True"]
    full, part = tmp_path / "full", tmp_path / "part"
    qs = os.path.join(ROOT, "configs", "quickstart.yaml")
    train_model(config.load_cfg(qs, [*common, "OUT_DIR", str(full)]))
    resume_from(full, part, 1)
    train_model(config.load_cfg(qs, [*common, "OUT_DIR", str(part)]))
    assert json_stats_of(part, "resume")[-1]["epoch"] == 1
    a = weight_files.read_weights(str(full / "model_final.safetensors"))
    b = weight_files.read_weights(str(part / "model_final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ #
# DDP, FSDP2 and the pipeline on 2 gloo processes against one process
# ------------------------------------------------------------------------------------------------ #

MUON = ["OPTIM.OPTIMIZER", "muon", "MUON.WEIGHT_DECAY", "0.1"]
ENGINES = {
    "ddp": ["TRAIN.PARALLEL", "ddp"],
    "fsdp": ["TRAIN.PARALLEL", "fsdp"],
    "pipeline": ["TRAIN.PARALLEL", "pipeline"],
    # tensor parallelism over both processes: each matrix gathered whole (its qkv rows in the
    # mesh's order, which Newton-Schulz's polynomial in G G^T carries through unchanged)
    "tensor": ["TRAIN.PARALLEL", "tensor", "MESH.TP", "2"],
}
# Whole training steps: float32 sums reordered by the engines, then a bfloat16 Newton-Schulz
# iteration whose polynomial multiplies the smallest singular directions by about 3.4 per step
# (a = 3.4445): a last-bit difference in a gradient moves an entry of the update by up to about
# 1e-3 after 5 steps. One process against itself at 2 threads instead of 1 (another order of the
# matmuls' sums) differs by 1.3e-3 (measured): the engines are held to that, and the optimizer
# itself to exact equality on equal gradients (test_fsdp_muon_equals_one_process_exactly)
ENGINE_WEIGHT_ATOL = 3e-3
FIXED_STEPS = 20


def _fixed_grads(module, step):
    """A gradient of each parameter, the same in every process for (name, step), as the global
    tensor; under FSDP2, each process's shard of it."""
    for name, p in module.named_parameters():
        gen = torch.Generator().manual_seed(1000 * step + zlib.crc32(name.encode()))
        g = torch.randn(p.shape, generator=gen) * 0.01
        if isinstance(p, DTensor):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def _fixed_steps(optimizer, module, start, stop):
    for step in range(start, stop):
        _fixed_grads(module, step)
        optimizer.step()


def _muon_worker(rank, world, port, out_dir):

    init_gloo(rank, world, port)
    try:
        results = {}
        for name, overrides in ENGINES.items():
            cfg = tiny_cfg(*MUON, *overrides)
            engine, optimizer, losses = run_steps(cfg, batches(cfg), rank, world)
            results[name] = {"losses": losses, "weights": engine.full_state_dict()}
        # The optimizer alone on equal gradients: FSDP2's shards, a checkpoint halfway
        cfg = tiny_cfg(*MUON, *ENGINES["fsdp"])
        engine, optimizer, _, _, _ = build(cfg)
        _fixed_steps(optimizer, engine.module, 0, FIXED_STEPS)
        path = engine.save(out_dir, 1, optimizer=optimizer, cfg_yaml=cfg.dump())
        _fixed_steps(optimizer, engine.module, FIXED_STEPS, 2 * FIXED_STEPS)
        results["fixed"] = {"path": path, "weights": engine.full_state_dict()}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "muon.pt"))
    finally:
        distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):

    out = str(tmp_path_factory.mktemp("muon"))
    spawn(_muon_worker, 2, out)
    return torch.load(os.path.join(out, "muon.pt"), weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_engines_on_two_processes_match_one(two_processes, name):

    cfg = tiny_cfg(*MUON)
    engine, _, losses = run_steps(cfg, batches(cfg))
    got = two_processes[name]
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(losses), rtol=LOSS_RTOL, atol=0
    )
    assert_weights_close(got["weights"], engine.module.state_dict(), atol=ENGINE_WEIGHT_ATOL)


@pytest.mark.slow
def test_fsdp_muon_equals_one_process_exactly(two_processes):
    """Equal gradients, 2 x 20 steps: FSDP2 on 2 processes (gathered whole matrices) and one
    process give the same weights bit for bit; its sharded checkpoint, written halfway by the 2
    processes, resumes in one process to those same weights."""

    got = two_processes["fixed"]
    cfg = tiny_cfg(*MUON)
    engine, optimizer, _, _, _ = build(cfg)
    _fixed_steps(optimizer, engine.module, 0, 2 * FIXED_STEPS)
    ref = engine.module.state_dict()
    assert_equal_muon_exact(got["weights"], ref, optimizer, engine.module)

    engine, optimizer, scaler, _, _ = build(cfg, seed=123)  # other weights, fresh state
    engine.load(got["path"], sharded.read_state(got["path"]), optimizer=optimizer, scaler=scaler)
    muon = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
    assert muon and all(optimizer.state[p]["momentum_buffer"].abs().sum() > 0 for p in muon)
    _fixed_steps(optimizer, engine.module, FIXED_STEPS, 2 * FIXED_STEPS)
    assert_equal_muon_exact(engine.module.state_dict(), ref, optimizer, engine.module)


def assert_equal_muon_exact(ours, ref, optimizer, module):
    """Muon's matrices bit for bit; the AdamW tensors to 1 ulp (torch's fused kernel rounds a
    vector body and a scalar tail differently, and a shard moves where the tail starts)."""
    names = {id(p): n for n, p in module.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    assert muon and [k for k in muon if not torch.equal(ours[k], ref[k])] == []
    for k in set(ref) - muon:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-5, atol=1e-8)
