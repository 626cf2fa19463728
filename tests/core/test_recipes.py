"""Training recipes: image-size curriculum, mixup/cutmix, EMA, accumulation, LR schedules and
the LR range test."""

import json
import math
import os

import pytest
import torch

from pycls.checkpoint import single_file as checkpoint
from pycls.config import load_cfg, read_cfg
from pycls.core import trainer
from pycls.core.builders import build_lr_schedule
from pycls.core.ema import ModelEMA
from pycls.core.lr_finder import lr_at, suggest_lr
from pycls.core.schedules import ImageSizeCurriculum, LRSchedule
from pycls.datasets import SeededSampler
from pycls.datasets.loading.transforms import BatchMixer, build_transform
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


# ---- DeiT III, as published ------------------------------------------------------------------ #

DEIT_REVISION = "7e160fe43f0252d17191b71cbb5826254114ea5b"
# facebookresearch/deit's README_revenge.md at DEIT_REVISION: the ImageNet-1k commands, after
# "python run_with_submitit.py" and "--data-path /path/to/imagenet", as written (line 81 runs
# "--repeated-aug--bce-loss" together, which argparse refuses: read as the two flags, as the
# other three pre-training commands give them). config file: (README line, command)
DEIT3_COMMANDS = {
    "deit3_s16.yaml": (81,
        "--model deit_small_patch16_LS --batch 256 --lr 4e-3 --epochs 800 --weight-decay 0.05 "
        "--sched cosine --input-size 224 --eval-crop-ratio 1.0 --reprob 0.0 --nodes 1 --ngpus 8 "
        "--smoothing 0.0 --warmup-epochs 5 --drop 0.0 --nb-classes 1000 --seed 0 --opt fusedlamb "
        "--warmup-lr 1e-6 --mixup .8 --drop-path 0.05 --cutmix 1.0 --unscale-lr "
        "--repeated-aug--bce-loss  --color-jitter 0.3 --ThreeAugment"),
    "deit3_b16.yaml": (412,
        "--model deit_base_patch16_LS --batch 256 --lr 3e-3 --epochs 800 --weight-decay 0.05 "
        "--sched cosine --input-size 192 --eval-crop-ratio 1.0 --reprob 0.0 --nodes 1 --ngpus 8 "
        "--smoothing 0.0 --warmup-epochs 5 --drop 0.0 --nb-classes 1000 --seed 0 --opt fusedlamb "
        "--warmup-lr 1e-6 --mixup .8 --drop-path 0.2 --cutmix 1.0 --unscale-lr --repeated-aug "
        "--bce-loss  --color-jitter 0.3 --ThreeAugment"),
    "deit3_l16.yaml": (745,
        "--model deit_large_patch16_LS --batch 64 --lr 3e-3 --epochs 800 --weight-decay 0.05 "
        "--sched cosine --input-size 192 --eval-crop-ratio 1.0 --reprob 0.0 --nodes 4 --ngpus 8 "
        "--smoothing 0.0 --warmup-epochs 5 --drop 0.0 --nb-classes 1000 --seed 0 --opt fusedlamb "
        "--warmup-lr 1e-6 --mixup .8 --drop-path 0.45 --cutmix 1.0 --unscale-lr --repeated-aug "
        "--bce-loss  --color-jitter 0.3 --ThreeAugment"),
    "deit3_h14.yaml": (1078,
        "--model deit_huge_patch14_LS --batch 64 --lr 3e-3 --epochs 800 --weight-decay 0.05 "
        "--sched cosine --input-size 160 --eval-crop-ratio 1.0 --reprob 0.0 --nodes 4 --ngpus 8 "
        "--smoothing 0.0 --warmup-epochs 5 --drop 0.0 --nb-classes 1000 --seed 0 --opt fusedlamb "
        "--warmup-lr 1e-6 --mixup .8 --drop-path 0.6 --cutmix 1.0 --unscale-lr --repeated-aug "
        "--bce-loss  --color-jitter 0.3 --ThreeAugment"),
    "finetune/deit3_b16_ft224.yaml": (1411,
        "--model deit_base_patch16_LS --batch 64 --lr 1e-5 --epochs 20 --weight-decay 0.1 "
        "--sched cosine --input-size 224 --eval-crop-ratio 1.0 --reprob 0.0 --nodes 1 --ngpus 8 "
        "--smoothing 0.1 --warmup-epochs 5 --drop 0.0 --nb-classes 1000 --seed 0 --opt adamw "
        "--warmup-lr 1e-6 --mixup .8 --drop-path 0.2 --cutmix 1.0 --unscale-lr  "
        "--aa rand-m9-mstd0.5-inc1 --no-repeated-aug --finetune model_path"),
    "finetune/deit3_l16_ft224.yaml": (1432,
        "--model deit_large_patch16_LS --batch 64 --lr 1e-5 --epochs 20 --weight-decay 0.1 "
        "--sched cosine --input-size 224 --eval-crop-ratio 1.0 --reprob 0.0 --nodes 1 --ngpus 8 "
        "--smoothing 0.1 --warmup-epochs 5 --drop 0.0 --nb-classes 1000 --seed 0 --opt adamw "
        "--warmup-lr 1e-6 --mixup .8 --drop-path 0.45 --cutmix 1.0 --unscale-lr  "
        "--aa rand-m9-mstd0.5-inc1 --no-repeated-aug --finetune model_path"),
    "finetune/deit3_h14_ft224.yaml": (1453,
        "--model deit_huge_patch14_LS --batch 32 --lr 1e-5 --epochs 20 --weight-decay 0.1 "
        "--sched cosine --input-size 224 --eval-crop-ratio 1.0 --reprob 0.0 --nodes 2 --ngpus 8 "
        "--smoothing 0.1 --warmup-epochs 5 --drop 0.0 --nb-classes 1000 --seed 0 --opt adamw "
        "--warmup-lr 1e-6 --mixup .8 --drop-path 0.55 --cutmix 1.0 --unscale-lr  "
        "--aa rand-m9-mstd0.5-inc1 --no-repeated-aug --finetune model_path"),
}  # fmt: skip
# What the commands leave to main.py's defaults (line), to models_v2.py (the *_LS models), to
# engine.py, augment.py and the timm 0.3.2 and apex FusedLAMB they run, at DEIT_REVISION
DEIT3_IMPLIED = {
    "main.py 81: --min-lr 1e-5": {"OPTIM.MIN_LR": 1e-5},
    "main.py 58: --opt-eps 1e-8": {"OPTIM.EPS": 1e-8},
    "main.py 60: --opt-betas None: FusedLAMB's and AdamW's (0.9, 0.999)": {
        "OPTIM.BETAS": [0.9, 0.999]},
    "main.py 134, 136: --mixup-prob 1.0, --mixup-switch-prob 0.5": {
        "MIXUP.PROB": 1.0, "MIXUP.SWITCH_PROB": 0.5},
    "main.py 51, 447: the EMA kept is never evaluated nor fine-tuned from": {"TRAIN.EMA": False},
    "timm 0.3.2 optim_factory.py 25-37: no decay on 1-D, biases, pos_embed, cls_token": {
        "OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP": 0.0},
    "models_v2.py 182: init_scale=1e-4 on both branches": {"VIT.LAYER_SCALE_INIT": 1e-4},
    "models_v2.py 200: the same drop-path rate in every block": {
        "VIT.DROP_PATH_SCHEDULE": "uniform"},
    "models_v2.py: LayerNorm eps 1e-6, no attention dropout, the class token's head": {
        "VIT.NORM_EPS": 1e-6, "VIT.ATTN_DROPOUT": 0.0, "VIT.CLASSIFIER": "token"},
    "models_v2.py 220-224: the head a Linear, trunc_normal(std 0.02)": {"VIT.HEAD_INIT_SCALE": 1.0},
    "engine.py 46: torch.cuda.amp.autocast(), float16 with loss scaling": {
        "AMP.LEVEL": "O1", "AMP.DTYPE": "float16"},
    "augment.py 93: ImageNet's mean and std": {
        "DATA.MEAN": [0.485, 0.456, 0.406], "DATA.STD": [0.229, 0.224, 0.225]},
}  # fmt: skip
DEIT3_MODELS = {
    "deit_small_patch16_LS": "deit3_s16", "deit_base_patch16_LS": "deit3_b16",
    "deit_large_patch16_LS": "deit3_l16", "deit_huge_patch14_LS": "deit3_h14",
}  # fmt: skip


def deit_args(command):
    """The command's arguments: ``{name: value}``, True for a flag."""
    words = command.replace("--repeated-aug--bce-loss", "--repeated-aug --bce-loss").split()
    args = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            following = words[i + 1] if i + 1 < len(words) else "--"
            args[word[2:]] = True if following.startswith("--") else following
    return args


def deit3_keys(a):
    """pycls's keys for DeiT's arguments ``a`` (what each becomes: docs/recipes.md's table)."""
    from pycls.models.vit.args import VIT_SPECS

    arch = DEIT3_MODELS[a["model"]]
    patch = VIT_SPECS[arch]["patch_size"]
    lamb = {"fusedlamb": True, "adamw": False}[a["opt"]]
    size = int(a["input-size"]) // patch * patch  # ViT-H's 160 px: the 154 its patches read
    keys = {
        "MODEL.ARCH": arch, "MODEL.NUM_CLASSES": int(a["nb-classes"]),
        "TRAIN.BATCH_SIZE": int(a["batch"]) * int(a["ngpus"]) * int(a["nodes"]),
        "OPTIM.BASE_LR": float(a["lr"]), "OPTIM.LR_SCALE_BATCH": 0 if a["unscale-lr"] else 512,
        "OPTIM.MAX_EPOCH": int(a["epochs"]), "OPTIM.WEIGHT_DECAY": float(a["weight-decay"]),
        "OPTIM.LR_POLICY": {"cosine": "cos"}[a["sched"]],
        "OPTIM.WARMUP_EPOCHS": float(a["warmup-epochs"]),
        "OPTIM.OPTIMIZER": "lamb" if lamb else "adamw",
        "OPTIM.CLIP_GRAD": 1.0 if lamb else 0.0,  # FusedLAMB's max_grad_norm; --clip-grad None
        "TRAIN.IM_SIZE": size, "TEST.IM_SIZE": size,
        "TRAIN.RANDOM_ERASING": float(a["reprob"]),
        "TRAIN.LABEL_SMOOTHING": float(a["smoothing"]),
        "TRAIN.REPEATED_AUG": 3 if a.get("repeated-aug") and not a.get("no-repeated-aug") else 1,
        "VIT.DROPOUT": float(a["drop"]), "VIT.DROP_PATH": float(a["drop-path"]),
        "MIXUP.ALPHA": float(a["mixup"]), "MIXUP.CUTMIX_ALPHA": float(a["cutmix"]),
        "RNG_SEED": int(a["seed"]),
        "MODEL.LOSS_FUN": "binary_cross_entropy" if a.get("bce-loss") else "cross_entropy",
        "TRAIN.AUGMENT": "three_augment" if a.get("ThreeAugment") else "deit3_finetune",
    }  # fmt: skip
    if a.get("bce-loss"):
        keys["MODEL.BCE_TARGET_THRESHOLD"] = 0.0  # engine.py 43-44: targets.gt(0.0)
    return keys


def _value(cfg, key):
    got = cfg
    for part in key.split("."):
        got = got[part]
    return list(got) if isinstance(got, (list, tuple)) else got


def deit3_cfg(name, *overrides):
    """The config as written (KEY VALUE ``overrides`` on top), not checked."""
    return read_cfg(os.path.join(ROOT, "configs", name), list(overrides))


def deit3_run_cfg(name, *overrides):
    """The config loaded for a run here: checked, resolved for this machine."""
    return load_cfg(os.path.join(ROOT, "configs", name), list(overrides))


@pytest.mark.parametrize("name", list(DEIT3_COMMANDS))
def test_the_deit3_configs_are_readme_revenges_commands_key_by_key(name):
    """Each config holds its README_revenge.md command (transcribed above) and what the command
    leaves to DeiT's defaults, key by key, and names the revision. Caught: a value changed in a
    file (LayerScale at MODEL.ARCH's 1e-6, the linear drop-path rule, the linearly scaled rate,
    bfloat16), a command mistranscribed into a config."""
    from pycls.datasets.loading import timm_augment, transforms

    line, command = DEIT3_COMMANDS[name]
    a = deit_args(command)
    cfg = deit3_cfg(name)
    expected = {f"README_revenge.md line {line}": deit3_keys(a), **DEIT3_IMPLIED}
    for source, keys in expected.items():
        for key, value in keys.items():
            got = _value(cfg, key)
            assert got == pytest.approx(value), f"{source}: {key} is {got!r}, DeiT's {value!r}"
    warmup_lr = cfg.OPTIM.BASE_LR * cfg.OPTIM.WARMUP_FACTOR
    assert warmup_lr == pytest.approx(float(a["warmup-lr"]), rel=1e-9)
    crop = transforms.eval_data_config(cfg.TRAIN.AUGMENT, cfg.TEST.IM_SIZE)
    assert (crop["crop_pct"], crop["interpolation"]) == (float(a["eval-crop-ratio"]), "bicubic")
    if a.get("ThreeAugment"):  # augment.py 115-116: its ColorJitter of --color-jitter
        assert float(a["color-jitter"]) == transforms.THREE_AUGMENT_JITTER
    else:
        assert a["aa"] == timm_augment.DEIT_RAND_AUGMENT
    with open(os.path.join(ROOT, "configs", name)) as f:
        assert DEIT_REVISION in f.read()


@pytest.mark.parametrize("size", ["b16", "l16", "h14"])
def test_each_deit3_fine_tune_starts_from_its_pre_training(size):
    """--finetune model_path: the fine-tune's TRAIN.WEIGHTS is the pre-training run's
    model_final.safetensors, a model of the same shape and LayerScale (another image size: its
    position embedding is resampled). Caught: a fine-tune reading another size's run."""
    pre = deit3_cfg(f"deit3_{size}.yaml")
    fine = deit3_cfg(f"finetune/deit3_{size}_ft224.yaml")
    assert os.path.join(pre.OUT_DIR, "model_final.safetensors") == fine.TRAIN.WEIGHTS
    for key in ("MODEL.ARCH", "VIT.WIDTH", "VIT.DEPTH", "VIT.PATCH_SIZE", "VIT.LAYER_SCALE_INIT"):
        assert _value(fine, key) == _value(pre, key), key
    assert fine.OUT_DIR != pre.OUT_DIR


def _timm_cosine(base_lr, epochs, min_lr, warmup_epochs, warmup_lr):
    """timm's CosineLRScheduler as DeiT's create_scheduler builds it (timm 0.3.2
    scheduler_factory.py 25-40, the same formula in today's timm), at the start of an epoch."""
    timm_scheduler = pytest.importorskip("timm.scheduler")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    sched = timm_scheduler.CosineLRScheduler(
        optimizer, t_initial=epochs, lr_min=min_lr, warmup_t=warmup_epochs,
        warmup_lr_init=warmup_lr, cycle_limit=1, t_in_epochs=True,
    )  # fmt: skip
    return lambda epoch: sched._get_lr(epoch)[0]


@pytest.mark.parametrize("name", ["deit3_b16.yaml", "finetune/deit3_b16_ft224.yaml"])
def test_the_deit3_schedules_are_timms_cosine_at_each_epoch(name):
    """At the start of every epoch the rate is timm's warmup-cosine of DeiT's arguments, to the
    1e-4 by which pycls's warmup (which ramps the cosine) and timm's (which ramps to the base
    rate) differ; the fine-tune's flat cosine (--min-lr = --lr) exactly. DeiT sets each epoch's
    rate once, one epoch late (docs/recipes.md). Caught: MIN_LR 0, the default WARMUP_FACTOR."""
    line, command = DEIT3_COMMANDS[name]
    a = deit_args(command)
    cfg = deit3_cfg(name)
    ours = build_lr_schedule(cfg, cfg.TRAIN.BATCH_SIZE, batches_per_epoch=625)
    theirs = _timm_cosine(float(a["lr"]), int(a["epochs"]), 1e-5, 5, float(a["warmup-lr"]))
    rel = 1e-4 if cfg.OPTIM.BASE_LR > cfg.OPTIM.MIN_LR else 1e-12
    for epoch in range(int(a["epochs"])):
        assert ours(epoch) == pytest.approx(theirs(epoch), rel=rel), epoch


@pytest.mark.parametrize("name", sorted(DEIT3_COMMANDS))
def test_info_mode_builds_each_deit3_model_without_data(name, capsys):
    """`--mode info` on each config: no data read, the model of README_revenge.md's table (its
    parameters within 0.5 %: the table's 22.0, 86.6, 304.4 and 632.1 M at 224 px; the position
    rows follow the image size)."""
    from pycls.core import cli

    published = {"deit3_s16": 22.0, "deit3_b16": 86.6, "deit3_l16": 304.4, "deit3_h14": 632.1}
    path = os.path.join(ROOT, "configs", name)
    assert cli.main(["--mode", "info", "--cfg", path]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "json_stats: " in line]
    stats = [json.loads(line.split("json_stats: ", 1)[1]) for line in lines]
    (complexity,) = [s for s in stats if s["_type"] == "complexity"]
    arch = deit3_cfg(name).MODEL.ARCH
    assert complexity["params"] / 1e6 == pytest.approx(published[arch], rel=5e-3)


# A tiny ViT on the bundled digits in place of ImageNet's ViT-B: every other key as the configs
TINY_DEIT3 = [
    "TRAIN.DATASET", "digits", "TEST.DATASET", "digits", "DATA.PATH", "", "DATA.CLASSES", "[0, 1]",
    "MODEL.NUM_CLASSES", "2", "VIT.PATCH_SIZE", "4", "VIT.DEPTH", "2", "VIT.WIDTH", "32",
    "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64", "TRAIN.BATCH_SIZE", "64", "TEST.BATCH_SIZE", "128",
    "OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0.5", "TRAIN.EVAL_PERIOD", "1",
    "DATA_LOADER.NUM_WORKERS", "0", "AMP.LEVEL", "O0", "DEVICE", "cpu", "CPU_THREADS", "1",
    "LOG_PERIOD", "1",
]  # fmt: skip


def test_deit3_b16_pre_trains_then_fine_tunes_from_its_weights_on_the_cpu(tmp_path):
    """configs/deit3_b16.yaml then its fine-tune, at a tiny width on two classes of the digits
    (16 px, then 24 px): LAMB with BCE, 3-Augment, repeated augmentation, mixup/cutmix, uniform
    drop path and LayerScale train; the fine-tune loads the pre-training's final weights (the
    position embedding resampled from 4 x 4 to 6 x 6 patches, every other tensor as saved) and
    trains with AdamW, cross-entropy and timm's RandAugment. Caught: a fine-tune that starts from
    fresh weights, a key of either config this pycls cannot run."""
    from safetensors.torch import load_file

    from pycls.core import finetune
    from pycls.core.builders import build_model

    pre_dir, fine_dir = tmp_path / "pre", tmp_path / "fine"
    pre = deit3_run_cfg("deit3_b16.yaml", *TINY_DEIT3, "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE",
                        "16", "OUT_DIR", str(pre_dir))  # fmt: skip
    trainer.train_model(pre)
    (epoch,) = json_stats_of(pre_dir, "train_epoch")
    assert math.isfinite(epoch["loss"]) and json_stats_of(pre_dir, "test_epoch")
    saved = load_file(str(pre_dir / "model_final.safetensors"))
    fine = deit3_run_cfg("finetune/deit3_b16_ft224.yaml", *TINY_DEIT3, "TRAIN.IM_SIZE", "24",
                         "TEST.IM_SIZE", "24", "OUT_DIR", str(fine_dir),
                         "TRAIN.WEIGHTS", str(pre_dir / "model_final.safetensors"))  # fmt: skip
    model = build_model(fine)
    finetune.prepare_model(fine, model)
    for key, value in model.state_dict().items():
        if key == "pos_embed":
            assert value.shape[1] == 1 + 36 and saved[key].shape[1] == 1 + 16
        elif key in saved:
            assert torch.equal(value, saved[key]), key
    assert {b.drop_path.p for b in model.blocks} == {0.2}  # uniform, the fine-tune's
    trainer.train_model(fine)
    (epoch,) = json_stats_of(fine_dir, "train_epoch")
    assert math.isfinite(epoch["loss"]) and json_stats_of(fine_dir, "test_epoch")
