"""Training recipes: image-size curriculum, mixup/cutmix, EMA, accumulation, LR schedules and
the LR range test."""

import math
import os

import pytest
import torch

from pycls.checkpoint import single_file as checkpoint
from pycls.core import trainer
from pycls.core.builders import build_lr_schedule
from pycls.core.ema import ModelEMA
from pycls.core.lr_finder import lr_at, suggest_lr
from pycls.core.schedules import ImageSizeCurriculum, LRSchedule
from pycls.datasets import SeededSampler
from pycls.datasets.transforms import BatchMixer, build_transform
from pycls.engines import resize as curriculum
from pycls.models import VisionTransformer
from pycls.optim import AdamW
from tests.helpers import json_stats_of, resume_from, tiny_quickstart

# ---- curriculum ------------------------------------------------------------------------------ #


def test_curriculum_sizes_and_batches():
    c = ImageSizeCurriculum(
        start=32,
        step=16,
        epochs_per_step=2,
        final=64,
        base_batch=64,
        scale_batch=True,
        batch_multiple=8,
    )
    assert [c.size(e) for e in range(8)] == [32, 32, 48, 48, 64, 64, 64, 64]
    # tokens per batch about constant: 64 * (64/32)^2 = 256; 64 * (64/48)^2 = 113.8 -> 112
    assert [c.batch_size(e) for e in (0, 2, 4)] == [256, 112, 64]
    fixed = ImageSizeCurriculum(start=32, step=16, epochs_per_step=1, final=64, base_batch=64)
    assert fixed.batch_size(0) == 64


def test_curriculum_resamples_in_place_and_the_optimizer_keeps_training_it():
    model = VisionTransformer(
        image_size=64,
        patch_size=16,
        depth=1,
        width=32,
        num_heads=2,
        mlp_dim=64,
        num_classes=5,
        classifier="token",
    )
    opt = AdamW(model.parameters(), lr=1e-2)
    ema = ModelEMA(model, decay=0.9)
    pos = model.pos_embed
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    opt.step()
    assert curriculum.set_image_size(model, 32, opt, ema)
    assert model.pos_embed is pos and pos.shape == (1, 1 + 4, 32)
    state = opt.state[pos]
    assert state["exp_avg"].shape == pos.shape and (state["exp_avg_sq"] >= 0).all()
    assert ema.tensors[ema.names.index("pos_embed")].shape == pos.shape
    before = pos.detach().clone()
    opt.zero_grad()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert pos.grad is not None and pos.grad.shape == pos.shape
    opt.step()
    assert not torch.equal(before, pos.detach())  # the optimizer updates the live parameter
    ema.update(model)
    assert not curriculum.set_image_size(model, 32, opt, ema)  # same size: nothing to do


def test_curriculum_run_logs_sizes_and_resumes_mid_curriculum(tmp_path):
    cur = [
        "CURRICULUM.ENABLED",
        "True",
        "CURRICULUM.START_SIZE",
        "8",
        "CURRICULUM.STEP",
        "4",
        "CURRICULUM.EPOCHS_PER_STEP",
        "1",
        "CURRICULUM.SCALE_BATCH",
        "True",
        "OPTIM.MAX_EPOCH",
        "3",
        "TRAIN.CHECKPOINT_PERIOD",
        "1",
        "TRAIN.EVAL_PERIOD",
        "1",
        "TRAIN.EMA",
        "True",
        "VIT.DROP_PATH",
        "0.1",
    ]
    full = tmp_path / "full"
    trainer.train_model(tiny_quickstart(full, *cur))
    epochs = json_stats_of(full, "train_epoch")
    assert [s["im_size"] for s in epochs] == [8, 12, 16]
    assert [s["batch_size"] for s in epochs] == [256, 113, 64]  # 64 * (16 / px)^2
    assert all(s["im_size"] == 16 for s in json_stats_of(full, "test_epoch"))  # final size
    assert len(json_stats_of(full, "test_epoch_ema")) == 3
    assert os.path.exists(checkpoint.get_best_checkpoint_path(str(full)))
    # Stopped after epoch 1 (at 8 px), resumed: same weights as the run never stopped
    resumed = tmp_path / "resumed"
    resume_from(full, resumed, epoch=1)
    trainer.train_model(tiny_quickstart(resumed, *cur))
    assert [s["im_size"] for s in json_stats_of(resumed, "train_epoch")] == [12, 16]
    a = torch.load(checkpoint.get_checkpoint_path(str(full), 3), weights_only=True)
    b = torch.load(checkpoint.get_checkpoint_path(str(resumed), 3), weights_only=True)
    for key in a["model_state"]:
        assert torch.equal(a["model_state"][key], b["model_state"][key]), key
    for key, value in a["ema_state"]["tensors"].items():
        assert torch.equal(value, b["ema_state"]["tensors"][key]), key


# ---- augmentation ---------------------------------------------------------------------------- #


@pytest.mark.parametrize("mixup, cutmix", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mixup_cutmix_soft_targets(mixup, cutmix):
    mixer = BatchMixer(10, mixup_alpha=mixup, cutmix_alpha=cutmix, prob=1.0, switch_prob=0.5)
    images, labels = torch.randn(6, 3, 16, 16), torch.randint(0, 10, (6,))
    mixed, targets = mixer(images, labels)
    assert mixed.shape == images.shape and targets.shape == (6, 10)
    torch.testing.assert_close(targets.sum(dim=1), torch.ones(6))
    # each row mixes its own label with one other sample's
    assert ((targets > 0).sum(dim=1) <= 2).all()
    assert (targets.gather(1, labels[:, None]) > 0).all()
    off = BatchMixer(10, mixup_alpha=mixup, cutmix_alpha=cutmix, off_epoch=3)
    assert off.active(2) and not off.active(3)
    assert not BatchMixer(10).enabled


@pytest.mark.parametrize("auto", ["randaugment", "trivialaugment", "autoaugment"])
def test_auto_augment_policies_keep_uint8_shape(auto):
    t = build_transform("imagenet", 32, True, auto_augment=auto, random_erasing=1.0)
    out = t(torch.randint(0, 256, (3, 48, 40), dtype=torch.uint8))
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    for preset in ("deit", "plain_vit"):
        assert build_transform(preset, 32, True)(out).shape == (3, 32, 32)
        assert build_transform(preset, 32, False)(out).shape == (3, 32, 32)


def test_repeated_augmentation_sampler():
    sampler = SeededSampler(12, shuffle=True, seed=0, image_size=8, repeats=3)
    keys = list(sampler)
    assert len(keys) == 12  # the epoch keeps its length
    indices = [k[0] for k in keys]
    assert indices[0] == indices[1] == indices[2] and len(set(indices)) == 4
    assert len({k[1] for k in keys}) == 12  # every copy is augmented differently
    ranks = [
        list(SeededSampler(12, shuffle=True, seed=0, image_size=8, repeats=3, rank=r, world_size=3))
        for r in range(3)
    ]
    assert [k[0] for k in ranks[0][:1]] == [ranks[1][0][0]] == [ranks[2][0][0]]


# ---- EMA ------------------------------------------------------------------------------------- #


def test_ema_equals_a_reference_ema():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    ema = ModelEMA(model, decay=0.99, warmup=True, period=2)
    ref = [p.detach().clone().double() for p in model.parameters()]
    calls = 0
    for step in range(1, 21):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        if step % 2 == 0:
            t = calls
            d = min(0.99, (1 + t) / (10 + t)) ** 2
            ref = [d * r + (1 - d) * p.detach().double() for r, p in zip(ref, model.parameters())]
            calls += 1
    for r, e in zip(ref, ema.tensors):
        torch.testing.assert_close(e.double(), r, rtol=1e-6, atol=1e-6)
    own = [p.detach().clone() for p in model.parameters()]
    with ema.swapped_into(model):
        for p, e in zip(model.parameters(), ema.tensors):
            assert torch.equal(p.detach(), e)
    for p, o in zip(model.parameters(), own):
        assert torch.equal(p.detach(), o)


def test_ema_averages_what_a_checkpoint_holds_not_the_drop_path_rates():
    """The rates are non-persistent buffers: an average swapped in would set a changed rate back,
    and an EMA saved before they were buffers must still load."""
    from pycls.models import VisionTransformer

    model = VisionTransformer(
        image_size=16, patch_size=8, depth=2, width=16, num_heads=2, mlp_dim=32, num_classes=4,
        pos_embed="sincos", drop_path=0.2,
    )  # fmt: skip
    ema = ModelEMA(model, decay=0.5)
    assert ema.names == [*(n for n, _ in model.named_parameters()), "pos_embed"]
    model.blocks[1].drop_path.p = 0.4
    with ema.swapped_into(model):
        assert model.blocks[1].drop_path.keep_prob.item() == pytest.approx(0.6)
    ema.load_state_dict(ModelEMA(model).state_dict())


# ---- accumulation ---------------------------------------------------------------------------- #


def test_accumulation_equals_one_step_of_the_whole_batch(tmp_path):
    common = ["OPTIM.MAX_EPOCH", "1", "TRAIN.EVAL_PERIOD", "1", "VIT.CLASSIFIER", "pooled"]
    runs = {}
    for k in (1, 4):
        out = tmp_path / f"accum{k}"
        trainer.train_model(tiny_quickstart(out, *common, "TRAIN.ACCUM_STEPS", str(k)))
        runs[k] = torch.load(checkpoint.get_checkpoint_path(str(out), 1), weights_only=True)
    for key, a in runs[1]["model_state"].items():
        b = runs[4]["model_state"][key]
        assert (a - b).norm() <= 1e-4 * a.norm() + 1e-6, key
    steps1 = json_stats_of(tmp_path / "accum1", "train_iter")[-1]["iter"]
    steps4 = json_stats_of(tmp_path / "accum4", "train_iter")[-1]["iter"]
    assert steps1 == steps4  # the same number of optimizer steps


# ---- schedules ------------------------------------------------------------------------------- #


def test_onecycle_and_cyclic_schedules():
    one = LRSchedule(
        base_lr=1.0,
        min_lr=0.0,
        max_epoch=10,
        policy="onecycle",
        onecycle_pct_start=0.3,
        onecycle_div_factor=25.0,
    )
    assert one(0) == pytest.approx(1 / 25) and one(3) == pytest.approx(1.0)
    assert one(10) == pytest.approx(0.0, abs=1e-12) and one(1) < one(2) < one(3) > one(5)
    cyc = LRSchedule(base_lr=1.0, min_lr=0.1, max_epoch=10, policy="cyclic", cycle_epochs=4)
    assert [round(cyc(e), 6) for e in (0, 1, 2, 3, 4)] == [0.1, 0.55, 1.0, 0.55, 0.1]
    warm = LRSchedule(
        base_lr=1.0, max_epoch=10, policy="constant", warmup_epochs=2, warmup_factor=0.1
    )
    assert warm(0) == pytest.approx(0.1) and warm(1) == pytest.approx(0.55) and warm(2) == 1.0


def test_lr_scale_rule(tmp_path):
    cfg = tiny_quickstart(tmp_path, "OPTIM.LR_SCALE_BATCH", "32", "OPTIM.WARMUP_EPOCHS", "0")
    assert build_lr_schedule(cfg)(0) == pytest.approx(2 * cfg.OPTIM.BASE_LR)  # batch 64


# ---- LR range test --------------------------------------------------------------------------- #


def test_lr_finder_helpers():
    assert lr_at(0, 11, 1e-5, 1e-0) == pytest.approx(1e-5)
    assert lr_at(10, 11, 1e-5, 1e-0) == pytest.approx(1.0)
    lrs = [10 ** (-5 + i * 0.25) for i in range(20)]
    # loss flat, then falls fastest around lr = 1e-3, then rises
    losses = [2.0 - math.tanh(2 * (math.log10(lr) + 3)) for lr in lrs[:14]] + [3, 4, 5, 6, 7, 8]
    assert 10**-3.5 <= suggest_lr(lrs, losses) <= 10**-2.5


def test_lrfind_mode_writes_table_and_plot(tmp_path):
    from pycls.core.lr_finder import find_lr

    cfg = tiny_quickstart(
        tmp_path, "LRFIND.NUM_ITERS", "30", "LRFIND.START_LR", "1e-5", "LRFIND.END_LR", "10.0"
    )
    result = find_lr(cfg)
    assert 1e-5 <= result["suggested_lr"] <= 10.0
    rows = (tmp_path / "lrfind.csv").read_text().splitlines()
    assert rows[0] == "lr,smoothed_loss" and len(rows) == 1 + len(result["lrs"]) > 5
    assert (tmp_path / "lrfind.png").stat().st_size > 0
    assert json_stats_of(tmp_path, "lrfind")[-1]["suggested_lr"] == pytest.approx(
        result["suggested_lr"], rel=1e-5
    )
