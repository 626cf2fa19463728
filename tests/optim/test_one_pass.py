"""OPTIM.ONE_PASS: AdamW, the O2 master copy, the EMA and gradient zeroing as one compiled pass
(pycls.optim.one_pass), against torch.optim.AdamW plus today's ModelEMA, compiled by inductor
on the CPU exactly as on a GPU."""

import copy

import pytest
import torch

from pycls import config
from pycls.core import compile_stats
from pycls.core.ema import ModelEMA
from pycls.engines.base import Engine
from pycls.engines.precision import DynamicLossScaler, Precision
from pycls.engines.resize import set_image_size
from pycls.errors import ConfigError
from pycls.optim import AdamW, OnePassAdamW, param_groups
from tests.helpers import tiny_vit

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

STEPS = 5
RTOL = 1e-5  # fp32: relative error of each tensor over the steps
BASE_LR, WD, DECAY = 1e-2, 0.05, 0.9


def groups_of(model, layer_decay):
    """The recipe's groups: weight decay / no decay, per layer with ``layer_decay`` < 1, each at
    its scaled base rate."""
    groups = param_groups(model, WD, layer_decay=layer_decay, depth=2)
    for g in groups:
        g["lr"] = BASE_LR * g.get("lr_scale", 1.0)
    return groups


def set_lr(opt, step):
    """A rate that changes every step, as the schedule sets it."""
    for g in opt.param_groups:
        g["lr"] = BASE_LR * g.get("lr_scale", 1.0) * (1 - step / (2 * STEPS))


def grads_for(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in model.parameters()]


def assert_close(ours, ref, rtol=RTOL):
    for a, b in zip(ours, ref):
        a, b = a.detach().float(), b.detach().float()
        err = (a - b).norm() / b.norm().clamp_min(1e-12)
        assert err <= rtol, f"relative error {err:.3g} > {rtol} for shape {tuple(a.shape)}"


def reference_run(model, layer_decay, ema_period, master):
    """torch.optim.AdamW (on fp32 masters under O2, the half weights rounded from them), then
    today's ModelEMA of the model's own weights, STEPS times."""
    weights = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().float()) for p in weights] if master else weights
    holder = copy.deepcopy(model) if master else model
    if master:  # groups built on the model, but stepping the fp32 masters
        for p, m in zip(holder.parameters(), masters):
            p.data = m.data
    opt = torch.optim.AdamW(groups_of(holder, layer_decay), foreach=True)
    ema = ModelEMA(model, decay=0.99, period=ema_period)
    for step in range(STEPS):
        set_lr(opt, step)
        for p, m, g in zip(weights, holder.parameters(), grads_for(model, step)):
            m.grad = g.to(p.dtype).float()
        opt.step()
        if master:
            for p, m in zip(weights, holder.parameters()):
                p.data.copy_(m.data)
        ema.update(model)
    return ema, list(holder.parameters())


def one_pass_run(model, layer_decay, ema_period, master):
    opt = OnePassAdamW(groups_of(model, layer_decay), master_weights=master)
    ema = ModelEMA(model, decay=0.99, period=ema_period)
    opt.attach_ema(ema, model)
    shadow = ModelEMA(model, decay=0.99, period=ema_period)  # today's EMA of the same weights
    counts = []
    for step in range(STEPS):
        set_lr(opt, step)
        opt.zero_grad()
        for p, g in zip(model.parameters(), grads_for(model, step)):
            p.grad.copy_(g)
        opt.step()
        ema.update(model)
        shadow.update(model)
        counts.append(compile_stats.snapshot()["unique_graphs"])
    assert_close(ema.tensors, shadow.tensors)
    return opt, ema, counts


@pytest.mark.parametrize(
    "level, layer_decay, ema_period",
    [("O0", 0.8, 2), ("O2", 1.0, 1)],
    ids=["O0_layer_decay_ema_every_2", "O2_master_decay_groups"],
)
def test_matches_torch_adamw_and_the_ema_without_recompiling(level, layer_decay, ema_period):
    """5 steps, a new learning rate at each: the weights (and O2's fp32 masters) and the EMA
    agree with torch.optim.AdamW and ModelEMA; graphs are compiled in the first steps only (one
    per EMA due / not due) and never again."""
    torch.manual_seed(0)
    model = Precision(level, "bfloat16").prepare_model(tiny_vit())
    ref_model = copy.deepcopy(model)
    master = level == "O2"
    ref_ema, ref_masters = reference_run(ref_model, layer_decay, ema_period, master)
    opt, ema, counts = one_pass_run(model, layer_decay, ema_period, master)
    assert len({(g["lr"], g["weight_decay"]) for g in opt.param_groups}) > 1  # segments differ
    masters = [opt.state[p].get("master", p) for p in model.parameters()]
    assert_close(masters, ref_masters)  # fp32: the weights, or O2's masters
    # The half weights are the masters rounded; an fp32 difference of 1e-7 may round the other
    # way, so they agree to a bfloat16 step (2^-8), and the EMA of them likewise
    half = [p.dtype == torch.bfloat16 for p in model.parameters()]
    assert any(half) == master
    assert all(torch.equal(m.to(p.dtype), p) for m, p in zip(masters, model.parameters()))
    assert_close(list(model.parameters()), list(ref_model.parameters()), 2**-8 if master else RTOL)
    assert_close(ema.tensors, ref_ema.tensors, 2**-8 if master else RTOL)
    assert ema.num_updates == ref_ema.num_updates == STEPS // ema_period
    settled = ema_period  # the graphs: one per EMA due / not due, then none
    assert counts[settled:] == [counts[settled - 1]] * (STEPS - settled), counts
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_clipping_and_float16_loss_scaling_compose():
    """Unscale, clip, then the pass: the same steps as the contiguous AdamW under the engine's
    own step, an overflowing step skipped by both."""
    torch.manual_seed(0)
    models = [tiny_vit(), None]
    models[1] = copy.deepcopy(models[0])
    opts = [OnePassAdamW(groups_of(models[0], 0.8)), AdamW(groups_of(models[1], 0.8),
                                                          contiguous=True)]  # fmt: skip
    scalers = [DynamicLossScaler(torch.device("cpu"), init_scale=4.0) for _ in opts]
    for step in range(3):
        for model, opt, scaler in zip(models, opts, scalers):
            set_lr(opt, step)
            opt.zero_grad()
            for p, g in zip(model.parameters(), grads_for(model, step)):
                p.grad.copy_(g * scaler.get_scale() * (float("inf") if step == 1 else 1.0))
            Engine(model, None, torch.device("cpu"), Precision()).step(opt, scaler, clip_grad=0.5)
    assert [s.skipped_steps for s in scalers] == [1, 1]
    assert_close(list(models[0].parameters()), list(models[1].parameters()))


def test_zero_grad_after_the_pass_has_nothing_left_to_do():
    torch.manual_seed(0)
    model = tiny_vit()
    opt = OnePassAdamW(groups_of(model, 0.8))
    opt.zero_grad()
    for p in model.parameters():
        p.grad.fill_(1.0)
    opt.step()
    flat = opt._buckets[0].grads.flat
    version = flat._version
    opt.zero_grad()  # the pass zeroed them: no memset
    assert flat._version == version and torch.count_nonzero(flat) == 0
    model(torch.randn(2, 3, 16, 16)).sum().backward()  # a backward writes: zero_grad clears it
    assert torch.count_nonzero(flat) > 0
    opt.zero_grad()
    assert torch.count_nonzero(flat) == 0
    assert all(p.grad.data_ptr() >= flat.data_ptr() for p in model.parameters())  # still views


def test_state_dicts_move_between_contiguous_and_one_pass_adamw():
    """The same per-parameter layout: a checkpoint of either resumes in the other exactly."""
    torch.manual_seed(0)
    a = tiny_vit()
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    ours, plain = OnePassAdamW(groups_of(a, 0.8)), AdamW(groups_of(b, 0.8), contiguous=True)
    for opt, model in ((ours, a), (plain, b)):
        for step in range(2):
            set_lr(opt, step)
            opt.zero_grad()
            for p, g in zip(model.parameters(), grads_for(model, step)):
                p.grad.copy_(g)
            opt.step()
    resumed = OnePassAdamW(groups_of(c, 0.8))
    resumed.load_state_dict(plain.state_dict())
    for p, q in zip(c.parameters(), b.parameters()):
        p.data.copy_(q.data)
    for opt, model in ((ours, a), (resumed, c)):
        set_lr(opt, 2)
        opt.zero_grad()
        for p, g in zip(model.parameters(), grads_for(model, 2)):
            p.grad.copy_(g)
        opt.step()
    assert_close(list(c.parameters()), list(a.parameters()))
    saved = resumed.state_dict()["state"]
    assert all(float(s["step"]) == 3 for s in saved.values())
    assert set(next(iter(saved.values()))) == {"step", "exp_avg", "exp_avg_sq"}


def test_groups_must_share_betas_and_one_device():
    model = tiny_vit()
    groups = groups_of(model, 1.0)
    groups[1]["betas"] = (0.8, 0.99)
    with pytest.raises(ValueError, match="share betas and eps"):
        OnePassAdamW(groups)


@pytest.mark.parametrize(
    "opts, key",
    [
        (["OPTIM.OPTIMIZER", "sgd", "OPTIM.CONTIGUOUS_PARAMS", "True"], "OPTIM.ONE_PASS"),
        (["OPTIM.OPTIMIZER", "adamw"], "OPTIM.ONE_PASS"),
        (["OPTIM.CONTIGUOUS_PARAMS", "True", "TRAIN.PARALLEL", "pipeline"], "OPTIM.ONE_PASS"),
    ],
    ids=["sgd", "not_contiguous", "pipeline"],
)
def test_the_key_is_refused_where_the_pass_cannot_run(opts, key):
    with pytest.raises(ConfigError, match=key):
        config.load_cfg(None, ["OPTIM.ONE_PASS", "True", *opts])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_torch_adamw_on_cuda():
    """The compiled pass on a GPU (Triton): O2 master weights and layer decay with the EMA."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Precision("O2", "bfloat16", "cuda").prepare_model(tiny_vit().cuda())
    ref_model = copy.deepcopy(model)
    ref_ema, ref_masters = reference_run(ref_model, 0.8, 1, True)
    opt, ema, counts = one_pass_run(model, 0.8, 1, True)
    assert_close([opt.state[p].get("master", p) for p in model.parameters()], ref_masters)
    assert_close(ema.tensors, ref_ema.tensors, 2**-8)
    assert counts[1:] == [counts[0]] * (STEPS - 1)


def test_a_curriculum_resize_carries_the_state_and_the_ema_into_new_buffers():
    """The position embedding resampled in place: moments, weights and the EMA's copy follow
    into the rebuilt buffers, and the steps after it equal the contiguous AdamW's with ModelEMA."""
    torch.manual_seed(0)
    models = [tiny_vit(), None]
    models[1] = copy.deepcopy(models[0])
    opts = [OnePassAdamW(groups_of(models[0], 1.0)), AdamW(groups_of(models[1], 1.0),
                                                          contiguous=True)]  # fmt: skip
    emas = [ModelEMA(m, decay=0.9) for m in models]
    opts[0].attach_ema(emas[0], models[0])
    for step in range(3):
        if step == 2:
            for model, opt, ema in zip(models, opts, emas):
                assert set_image_size(model, 24, opt, ema)
        for model, opt, ema in zip(models, opts, emas):
            opt.zero_grad()
            for p in model.parameters():
                p.grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
            opt.step()
            ema.update(model)
    assert_close(list(models[0].parameters()), list(models[1].parameters()))
    assert_close(emas[0].tensors, emas[1].tensors)
    pos = emas[0].names.index("pos_embed")
    flat = opts[0]._buckets[0].ema.flat
    assert emas[0].tensors[pos].shape == models[0].pos_embed.shape
    assert flat.data_ptr() <= emas[0].tensors[pos].data_ptr() < flat.data_ptr() + flat.nbytes
