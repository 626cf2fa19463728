"""Training recipes: image-size curriculum, mixup/cutmix, EMA, accumulation, LR schedules and
the LR range test."""

import math
import os

import pytest
import torch

from pycls.checkpoint import single_file as checkpoint
from pycls.config import read_cfg
from pycls.core import trainer
from pycls.core.builders import build_lr_schedule
from pycls.core.ema import ModelEMA
from pycls.core.lr_finder import lr_at, suggest_lr
from pycls.core.schedules import ImageSizeCurriculum, LRSchedule
from pycls.datasets import SeededSampler
from pycls.datasets.loaders.transforms import BatchMixer, build_transform
from pycls.engines import resize as curriculum
from pycls.models import VisionTransformer
from pycls.optim import AdamW
from tests.helpers import ROOT, json_stats_of, resume_from, tiny_quickstart

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


# ---- big_vision's plain ViT, as published --------------------------------------------------- #

BIG_VISION_FILE = "configs/vit_s16_bigvision.yaml"
# google-research/big_vision, big_vision/configs/vit_s16_i1k.py at
# 0127fb6b337ee2a27bf4e54dea79cff176527356 (with the defaults of the code it names: optax's
# scale_by_adam, models/vit.py, optax.py, utils.py): its key and value -> pycls's keys and values
BIG_VISION = {
    "seed = 0": {"RNG_SEED": 0},
    "total_epochs = 90": {"OPTIM.MAX_EPOCH": 90},
    "num_classes = 1000": {"MODEL.NUM_CLASSES": 1000},
    "loss = 'softmax_xent' (one-hot labels)": {
        "MODEL.LOSS_FUN": "cross_entropy", "TRAIN.LABEL_SMOOTHING": 0.0},
    "input.batch_size = 1024": {"TRAIN.BATCH_SIZE": 1024},
    "input.pp: decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2,10)": {
        "TRAIN.IM_SIZE": 224, "TRAIN.AUGMENT": "big_vision"},
    "pp_common: value_range(-1, 1)": {"DATA.MEAN": [0.5] * 3, "DATA.STD": [0.5] * 3},
    "pp_eval: resize_small(256)|central_crop(224)": {"TEST.IM_SIZE": 224},
    "evals.val: split 'validation'": {"TEST.SPLIT": "val"},
    "model.variant = 'S/16'": {
        "VIT.PATCH_SIZE": 16, "VIT.WIDTH": 384, "VIT.DEPTH": 12, "VIT.NUM_HEADS": 6,
        "VIT.MLP_DIM": 1536},
    "model.rep_size = True (the width)": {"VIT.REPRESENTATION_SIZE": 384},
    "model.pool_type = 'gap' (encoder_norm, then the mean)": {
        "VIT.CLASSIFIER": "pooled", "VIT.CLASS_TOKEN": False, "VIT.FC_NORM": False},
    "model.posemb = 'sincos2d'": {"VIT.POS_EMBED": "sincos"},
    "vit.py: head_zeroinit = True, dropout = 0": {
        "VIT.HEAD_INIT_SCALE": 0.0, "VIT.DROPOUT": 0.0, "VIT.DROP_PATH": 0.0},
    "grad_clip_norm = 1.0": {"OPTIM.CLIP_GRAD": 1.0},
    "optax_name = 'scale_by_adam' (b1 0.9, b2 0.999, eps 1e-8)": {
        "OPTIM.OPTIMIZER": "adamw", "OPTIM.BETAS": [0.9, 0.999], "OPTIM.EPS": 1e-8},
    "lr = 0.001 (not scaled by the batch)": {"OPTIM.BASE_LR": 0.001, "OPTIM.LR_SCALE_BATCH": 0},
    "wd = 0.0001, times the schedule (optax.py: decoupled, after scale(lr))": {
        "OPTIM.WEIGHT_DECAY": 0.0001, "OPTIM.WEIGHT_DECAY_SCALE": "schedule"},
    "wd_mults default: kernels only": {"OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP": 0.0},
    "schedule.warmup_steps = 10_000 (linear from 0)": {
        "OPTIM.WARMUP_STEPS": 10000, "OPTIM.WARMUP_EPOCHS": 0.0, "OPTIM.WARMUP_FACTOR": 0.0},
    "schedule.decay_type = 'cosine' (to 0, after the warmup)": {
        "OPTIM.LR_POLICY": "cos", "OPTIM.MIN_LR": 0.0, "OPTIM.WARMUP_PREFIX": True},
    "mixup = dict(p=0.2): every batch": {
        "MIXUP.ALPHA": 0.2, "MIXUP.PROB": 1.0, "MIXUP.CUTMIX_ALPHA": 0.0},
}  # fmt: skip


def big_vision_lr(step, total, warmup=10_000, base=1e-3):
    """big_vision/utils.py create_learning_rate_schedule(decay_type='cosine') at ``step``."""
    progress = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress)) * min(1.0, step / warmup)


def test_the_plain_vit_config_is_big_visions_key_by_key():
    """configs/vit_s16_bigvision.yaml holds every value of the table transcribed from
    vit_s16_i1k.py (at the revision above). Caught: any value changed in the file (label
    smoothing 0.1, the warmup in epochs)."""
    cfg = read_cfg(os.path.join(ROOT, BIG_VISION_FILE), [])
    for source, keys in BIG_VISION.items():
        for key, value in keys.items():
            got = cfg
            for part in key.split("."):
                got = got[part]
            got = list(got) if isinstance(got, (list, tuple)) else got
            assert got == value, f"{source}: {key} is {got!r}, big_vision's is {value!r}"
    with open(os.path.join(ROOT, BIG_VISION_FILE)) as f:
        assert "0127fb6b337ee2a27bf4e54dea79cff176527356" in f.read()  # the revision it follows


def test_the_plain_vit_schedule_is_big_visions_step_by_step():
    """OPTIM.WARMUP_STEPS with WARMUP_PREFIX and cos: the rate of every step is big_vision's
    cosine schedule over the same steps (90 epochs of 1251 steps: ImageNet's 1,281,167 images
    at batch 1024). Caught: the cosine spanning the warmup too (WARMUP_PREFIX off)."""
    steps = 1251
    cfg = read_cfg(os.path.join(ROOT, BIG_VISION_FILE), [])
    schedule = build_lr_schedule(cfg, 1024, batches_per_epoch=steps)
    total = 90 * steps
    for step in (0, 1, 2500, 9999, 10_000, 10_001, 40_000, 80_000, total - 1):
        assert schedule(step / steps) == pytest.approx(
            big_vision_lr(step, total), rel=1e-9, abs=1e-15
        )


def test_warmup_steps_count_optimizer_steps_of_the_run():
    """WARMUP_STEPS over the batches of an epoch and TRAIN.ACCUM_STEPS: 40 steps of 20 batches
    of which 2 make a step are 4 epochs; with WARMUP_PREFIX False the cosine spans the run."""
    cfg = tiny_quickstart("/tmp", "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.WARMUP_STEPS", "40",
                          "TRAIN.ACCUM_STEPS", "2", "OPTIM.WARMUP_FACTOR", "0.0")  # fmt: skip
    schedule = build_lr_schedule(cfg, batches_per_epoch=20)
    assert schedule.warmup_epochs == 4.0
    base = cfg.OPTIM.BASE_LR
    assert schedule(2.0) == pytest.approx(0.5 * schedule._policy(2.0))
    assert schedule._policy(4.0) < base  # the decay began at epoch 0
    with pytest.raises(Exception, match="OPTIM.WARMUP_STEPS: .*WARMUP_EPOCHS"):
        tiny_quickstart("/tmp", "OPTIM.WARMUP_STEPS", "40")  # the quickstart warms 5 epochs
