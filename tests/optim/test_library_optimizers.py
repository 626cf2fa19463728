"""Other libraries' optimizers (pycls.optim.library_optimizers, library_names): timm's registry by
name and Schedule-Free AdamW on pycls's parameter groups and schedule, against the libraries'
own classes on the same groups; Schedule-Free's two weight points (evaluation, checkpoints);
the names the config takes, checked without torch; the weight decay scaled by the schedule
(OPTIM.WEIGHT_DECAY_SCALE) against big_vision's update; exact resume in the trainer."""

import ast
import copy
import os
import subprocess
import sys

import pytest
import schedulefree
import timm.optim
import torch
from safetensors.torch import load_file

from pycls.checkpoint import single_file as checkpoint
from pycls.config import ConfigError
from pycls.core import trainer
from pycls.core.schedules import set_lr
from pycls.optim import OptimizerSettings, optimizer_from_settings, param_groups
from pycls.optim.library_names import (
    TIMM_LEFT_OUT,
    TIMM_NOT_UNDER_FSDP,
    TIMM_OPTIMIZERS,
    closest_names,
)
from pycls.optim.library_optimizers import SCHEDULE_FREE_GROUP_STATE, evaluation_weights
from tests.helpers import QUICKSTART, ROOT, json_stats_of, resume_from, tiny_quickstart, tiny_vit

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

RATES = [0.0, 4e-4, 8e-4, 1e-3, 1e-3]  # a warmup, then constant: what set_lr gives each step


def frozen_tiny_vit():
    """The tiny ViT with its first block frozen (TRAIN.FREEZE's effect): no group holds it."""
    model = tiny_vit()
    model.blocks[0].requires_grad_(False)
    return model


def train(model, optimizer, steps=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    for lr in RATES[:steps]:
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        images = torch.randn(4, 3, 16, 16, generator=g)
        torch.nn.functional.cross_entropy(model(images), torch.arange(4)).backward()
        optimizer.step()


def ours(model, name, **settings):
    kw = dict(name=name, lr=1e-3, weight_decay=0.05, layer_decay=0.75, depth=2)
    return optimizer_from_settings(model, OptimizerSettings(**{**kw, **settings}))


def pycls_groups(model):
    """The groups pycls builds: decay / no-decay, per layer (layer decay 0.75 over 2 blocks)."""
    groups = param_groups(model, 0.05, 0.0, layer_decay=0.75, depth=2)
    for group in groups:
        group["lr"] = 1e-3 * group.get("lr_scale", 1.0)
    return groups


# ---- names ------------------------------------------------------------------------------------- #


def test_the_names_are_the_installed_timms_registry():
    """TIMM_OPTIMIZERS and TIMM_LEFT_OUT share out timm's registry; FSDP2's refusals are names
    of it. Caught: a name timm added (or dropped) without the list following."""
    registry = set(timm.optim.list_optimizers())
    assert set(TIMM_OPTIMIZERS) | set(TIMM_LEFT_OUT) == registry
    assert not set(TIMM_OPTIMIZERS) & set(TIMM_LEFT_OUT)
    assert set(TIMM_NOT_UNDER_FSDP) <= set(TIMM_OPTIMIZERS)


def test_reading_a_config_with_library_optimizers_imports_neither_torch_nor_timm():
    """The config floor holds for timm:NAME and schedulefree_adamw; an unknown name is one line
    with the closest names (a bare timm name finds its timm: spelling)."""
    code = (
        "import sys; from pycls.config import read_cfg; "
        "read_cfg(sys.argv[1], ['OPTIM.OPTIMIZER', 'timm:lion']); "
        "read_cfg(sys.argv[1], ['OPTIM.OPTIMIZER', 'schedulefree_adamw', 'OPTIM.LR_POLICY', "
        "'constant']); print(sorted(sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code, QUICKSTART], capture_output=True, text=True,
                       env=env, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    loaded = {m.split(".")[0] for m in ast.literal_eval(p.stdout.strip().splitlines()[-1])}
    assert not loaded & {"torch", "timm", "schedulefree"}
    assert closest_names("lion")[0] == "timm:lion"
    with pytest.raises(ConfigError, match=r"^OPTIM.OPTIMIZER: 'timm:laprp' .*closest: timm:lap"):
        tiny_quickstart("/tmp", "OPTIM.OPTIMIZER", "timm:laprp")


def test_what_other_libraries_optimizers_cannot_do_is_refused_in_one_line(tmp_path):
    """Schedule-Free replaces the decaying schedule; no library optimizer keeps O2's master
    weights or pycls's flat buffers; the pipeline and tensor engines are untested (the rule)."""
    sf = ("OPTIM.OPTIMIZER", "schedulefree_adamw")
    cases = {
        "OPTIM.LR_POLICY: 'cos' decays the rate": (*sf, "OPTIM.LR_POLICY", "cos"),
        "OPTIM.OPTIMIZER: timm:lion keeps no fp32 master weights, which AMP.LEVEL O2": (
            "OPTIM.OPTIMIZER", "timm:lion", "AMP.LEVEL", "O2"),
        "OPTIM.CONTIGUOUS_PARAMS: the flat buffers": (
            *sf, "OPTIM.LR_POLICY", "constant", "OPTIM.CONTIGUOUS_PARAMS", "True"),
        "OPTIM.OPTIMIZER: cannot be used with TRAIN.PARALLEL pipeline": (
            "OPTIM.OPTIMIZER", "timm:lion", "TRAIN.PARALLEL", "pipeline"),
        "OPTIM.OPTIMIZER: cannot be used with TRAIN.PARALLEL tensor": (
            *sf, "OPTIM.LR_POLICY", "constant", "TRAIN.PARALLEL", "tensor"),
    }  # fmt: skip
    for message, overrides in cases.items():
        with pytest.raises(ConfigError) as e:
            tiny_quickstart(tmp_path, *overrides)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    if TIMM_NOT_UNDER_FSDP:
        name = next(iter(TIMM_NOT_UNDER_FSDP))
        with pytest.raises(ConfigError, match=rf"^OPTIM.OPTIMIZER: timm:{name} cannot step FSDP2"):
            tiny_quickstart(tmp_path, "OPTIM.OPTIMIZER", f"timm:{name}", "TRAIN.PARALLEL", "fsdp")


# ---- timm ----------------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["lion", "laprop", "lamb", "mars"])
def test_a_timm_optimizer_steps_as_timms_own_class_on_pycls_groups(name):
    """timm:NAME is timm's class over pycls's groups (frozen parameters left out, the no-decay
    group without decay, layer decay's per-group rates set by the schedule), bitwise. Caught:
    groups rebuilt by timm (its no-decay rule), betas from OPTIM.BETAS not reaching it."""
    model = frozen_tiny_vit()
    reference = copy.deepcopy(model)
    optimizer = ours(model, f"timm:{name}", betas=(0.9, 0.99))
    info = timm.optim.get_optimizer_info(name)
    kwargs = {**(info.defaults or {}), "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    if name == "lion":
        kwargs.pop("eps")
    expected = info.opt_class(pycls_groups(reference), lr=1e-3, **kwargs)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in held for p in model.blocks[0].parameters())
    no_decay = [g["weight_decay"] for g in optimizer.param_groups if "no_decay" in g["name"]]
    assert no_decay == [0.0] * 3
    train(model, optimizer)
    train(reference, expected)
    for (k, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), k


def test_optimizers_with_other_than_two_betas_keep_their_own():
    """Adan takes three betas: OPTIM.BETAS' two do not reach it (timm's defaults stay)."""
    optimizer = ours(tiny_vit(), "timm:adan", betas=(0.9, 0.99))
    assert len(optimizer.param_groups[0]["betas"]) == 3


# ---- Schedule-Free --------------------------------------------------------------------------- #


def test_schedule_free_steps_as_the_package_on_pycls_groups():
    """schedulefree_adamw is the package's AdamWScheduleFree over pycls's groups, its warmup
    left to the schedule (set_lr), bitwise; the evaluation weights are the package's eval()."""
    model = frozen_tiny_vit()
    reference = copy.deepcopy(model)
    optimizer = ours(model, "schedulefree_adamw")
    expected = schedulefree.AdamWScheduleFree(pycls_groups(reference), lr=1e-3, warmup_steps=0,
                                              weight_decay=0.05)  # fmt: skip
    expected.train()
    train(model, optimizer)
    train(reference, expected)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    expected.eval()
    with evaluation_weights(optimizer):
        for a, b in zip(model.parameters(), reference.parameters()):
            assert torch.equal(a, b)


def test_evaluation_weights_give_x_then_y_back_bitwise():
    """Within the context the model holds x, the package's eval() point (y moved towards z by
    1 - 1 / beta1); after it, y bitwise, not y recomputed from x (which rounds); a nested context
    switches nothing. Caught: leaving by optimizer.train() (y from x: off by rounding)."""
    model = tiny_vit()
    optimizer = ours(model, "schedulefree_adamw")
    train(model, optimizer)
    y = [p.detach().clone() for p in model.parameters()]
    beta1 = optimizer.param_groups[0]["betas"][0]
    x = [p.lerp(optimizer.state[p]["z"], 1 - 1 / beta1) for p in model.parameters()]
    with evaluation_weights(optimizer):
        with evaluation_weights(optimizer):
            inner = [p.detach().clone() for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), x))
        assert all(torch.equal(a, b) for a, b in zip(inner, x))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), y))
    assert all(g["train_mode"] for g in optimizer.param_groups)


def test_a_checkpoint_holds_x_as_the_model_and_y_in_the_state():
    """Written within the context: the model's weights are x, the optimizer state has y beside z;
    a fresh model and optimizer loading both continue bitwise as the one never stopped, and
    the group's running counts come back from the checkpoint, not the config."""
    model = tiny_vit()
    optimizer = ours(model, "schedulefree_adamw")
    train(model, optimizer, steps=3)
    with evaluation_weights(optimizer):
        model_state = copy.deepcopy(model.state_dict())
        optim_state = copy.deepcopy(optimizer.state_dict())
    assert all("y" in s and "z" in s for s in optim_state["state"].values())
    assert not optim_state["param_groups"][0]["train_mode"]
    fresh = tiny_vit()
    torch.manual_seed(9)
    fresh.head.weight.data.normal_()  # other weights, overwritten by the load
    resumed = ours(fresh, "schedulefree_adamw")
    fresh.load_state_dict(model_state)
    resumed.load_state_dict(optim_state)
    assert resumed.param_groups[0]["k"] == 3 and resumed.param_groups[0]["train_mode"]
    assert all("y" not in s for s in resumed.state.values())
    train(model, optimizer, steps=2, seed=1)
    train(fresh, resumed, steps=2, seed=1)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert set(SCHEDULE_FREE_GROUP_STATE) <= set(optimizer.param_groups[0])


# ---- weight decay scaled by the schedule ------------------------------------------------------ #


def test_weight_decay_scaled_by_the_schedule_is_big_visions_update():
    """OPTIM.WEIGHT_DECAY_SCALE schedule: big_vision's optax chain (big_vision/optax.py ``make``:
    scale_by_adam, scale(lr), add_decayed_weights(wd), scale_by_schedule(s), scale(-1)) moves a
    weight by s (lr adam + wd w): the decay follows the schedule's factor s, not the rate, and
    layer decay scales only the rate. Caught: dividing by the base rate without the group's
    layer scale."""
    model = tiny_vit()
    reference = copy.deepcopy(model)
    wd, lr = 1e-2, 1e-3  # a strong decay, so that a wrong one shows above the rounding
    optimizer = ours(model, "adamw", weight_decay=wd, weight_decay_scale="schedule", lr=lr)
    groups = param_groups(reference, wd, 0.0, layer_decay=0.75, depth=2)
    adam = [torch.optim.Adam([p], lr=1.0, betas=(0.9, 0.999), eps=1e-8) for g in groups
            for p in g["params"]]  # fmt: skip
    scales = [(g.get("lr_scale", 1.0), g["weight_decay"]) for g in groups for _ in g["params"]]
    params = [p for g in groups for p in g["params"]]
    g = torch.Generator().manual_seed(0)
    for rate in RATES:
        images = torch.randn(4, 3, 16, 16, generator=g)
        set_lr(optimizer, rate)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), torch.arange(4)).backward()
        optimizer.step()
        reference.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(reference(images), torch.arange(4)).backward()
        s = rate / lr  # the schedule's factor
        with torch.no_grad():
            for p, a, (scale, decay) in zip(params, adam, scales):
                before = p.detach().clone()
                a.step()  # p <- p - adam update (lr 1): the update is before - p
                update = before - p
                p.copy_(before - s * (lr * scale * update + decay * before))
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=5e-7, rtol=0)  # the reference's own rounding


def test_weight_decay_by_the_schedule_needs_an_unscaled_rate(tmp_path):
    with pytest.raises(ConfigError, match=r"^OPTIM.WEIGHT_DECAY_SCALE: .*LR_SCALE_BATCH"):
        tiny_quickstart(tmp_path, "OPTIM.WEIGHT_DECAY_SCALE", "schedule", "OPTIM.LR_SCALE_BATCH",
                        "256")  # fmt: skip


# ---- the trainer ------------------------------------------------------------------------------ #

TRAINED = {
    "schedulefree_ema": ["OPTIM.OPTIMIZER", "schedulefree_adamw", "OPTIM.LR_POLICY", "constant",
                         "TRAIN.EMA", "True", "TRAIN.EMA_DECAY", "0.9"],
    "timm_lion": ["OPTIM.OPTIMIZER", "timm:lion", "OPTIM.BASE_LR", "0.0003"],
    "timm_lamb": ["OPTIM.OPTIMIZER", "timm:lamb"],  # counts its steps in its groups
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINED))
def test_a_stopped_run_resumes_bitwise_and_keeps_the_evaluation_weights(tmp_path, name):
    """4 epochs straight against 2, stopped, and resumed in a fresh OUT_DIR: the final weights
    (and the EMA) bitwise the same; Schedule-Free's model_final.safetensors and checkpoints
    hold x, its evaluation the same x. Caught: the group's step count restored from the config
    (Schedule-Free's k back to 0), a checkpoint without y (y rebuilt from x: off by rounding)."""
    args = ["OPTIM.MAX_EPOCH", "4", "OPTIM.WARMUP_EPOCHS", "1", "TRAIN.EVAL_PERIOD", "2",
            "TRAIN.CHECKPOINT_PERIOD", "2", *TRAINED[name]]  # fmt: skip
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    trainer.train_model(tiny_quickstart(full, *args))
    resume_from(full, resumed, 2)
    trainer.train_model(tiny_quickstart(resumed, *args))
    final = load_file(str(full / "model_final.safetensors"))
    again = load_file(str(resumed / "model_final.safetensors"))
    assert all(torch.equal(final[k], again[k]) for k in final)
    last = checkpoint.load_file(checkpoint.get_checkpoint_path(str(full), 4))
    last_resumed = checkpoint.load_file(checkpoint.get_checkpoint_path(str(resumed), 4))
    for k, v in last["model_state"].items():
        assert torch.equal(v, last_resumed["model_state"][k]), k
        assert torch.equal(v, final[k]), k  # the export is what the checkpoint keeps
    if "ema_state" in last:
        for k, v in last["ema_state"]["tensors"].items():
            assert torch.equal(v, last_resumed["ema_state"]["tensors"][k]), k
    tests = [s["top1_err"] for s in json_stats_of(resumed, "test_epoch")]
    assert tests == [s["top1_err"] for s in json_stats_of(full, "test_epoch")][-len(tests) :]
    if name.startswith("schedulefree"):
        ys = [s["y"] for s in last["optimizer_state"]["state"].values()]
        assert any(not torch.equal(y, x) for y, x in zip(ys, last["model_state"].values()))
