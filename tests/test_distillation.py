"""Distillation (DISTILL.*, VIT.DIST_TOKEN): DeiT's loss on fixed logits; the distillation token
and head (timm's deit_*_distilled layout, both ways); the teacher (eval mode, no gradients, the
run's autocast, outside the engine's state); training, resuming and the engines with a teacher."""

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import QUICKSTART, ROOT, TINY, json_stats_of, resume_from
from test_distributed import (
    LOSS_RTOL,
    WEIGHT_ATOL,
    _init,
    assert_weights_close,
    batches,
    spawn,
    tiny_cfg,
)

from pycls import config, distributed
from pycls.checkpoint import sharded, weight_files
from pycls.config import ConfigError
from pycls.core import builders
from pycls.core.distillation import DistillationLoss, Teacher
from pycls.core.trainer import build_training, train_model
from pycls.engines import Precision
from pycls.models import VisionTransformer, convert
from pycls.models.vit import from_timm

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


# ------------------------------------------------------------------------------------------------ #
# DeiT's loss on fixed logits
# ------------------------------------------------------------------------------------------------ #


def deit_loss(base, outputs, teacher_outputs, labels, kind, alpha, tau):
    """facebookresearch/deit losses.py's DistillationLoss.forward, with the teacher's outputs
    given (the reference, line for line)."""
    outputs, outputs_kd = outputs
    base_loss = base(outputs, labels)
    if kind == "soft":
        T = tau
        distillation_loss = (
            F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1),
                F.log_softmax(teacher_outputs / T, dim=1),
                reduction="sum",
                log_target=True,
            )
            * (T * T)
            / outputs_kd.numel()
        )
    else:
        distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
    return base_loss * (1 - alpha) + distillation_loss * alpha


@pytest.mark.parametrize("kind,alpha,tau", [("hard", 0.5, 1.0), ("soft", 0.5, 1.0),
                                            ("soft", 0.3, 3.0), ("hard", 1.0, 1.0)])  # fmt: skip
@pytest.mark.parametrize("soft_targets", [False, True], ids=["labels", "mixup_targets"])
def test_loss_is_deits_on_fixed_logits(kind, alpha, tau, soft_targets):
    gen = torch.Generator().manual_seed(0)
    cls, dist, teacher = (torch.randn(8, 10, generator=gen) * 3 for _ in range(3))
    labels = torch.randint(0, 10, (8,), generator=gen)
    if soft_targets:  # what mixup gives the base loss
        labels = torch.softmax(torch.randn(8, 10, generator=gen), dim=1)
    base = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    ours = DistillationLoss(base, kind, alpha, tau)((cls, dist), teacher, labels)
    ref = deit_loss(base, (cls, dist), teacher, labels, kind, alpha, tau)
    assert torch.equal(ours, ref)
    # bound, as the engine calls it
    assert torch.equal(DistillationLoss(base, kind, alpha, tau).bind(teacher)((cls, dist), labels),
                       ref)  # fmt: skip


def test_one_head_takes_both_terms_and_no_teacher_supervises_with_the_targets():
    gen = torch.Generator().manual_seed(1)
    logits, teacher = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    labels = torch.tensor([0, 1, 2, 3])
    base = torch.nn.CrossEntropyLoss()
    loss = DistillationLoss(base, "hard", 0.25)
    expected = 0.75 * base(logits, labels) + 0.25 * F.cross_entropy(logits, teacher.argmax(1))
    torch.testing.assert_close(loss(logits, teacher, labels), expected)
    cls, dist = logits, teacher
    expected = 0.75 * base(cls, labels) + 0.25 * base(dist, labels)
    torch.testing.assert_close(loss((cls, dist), None, labels), expected)
    with pytest.raises(ValueError, match="alpha"):
        DistillationLoss(base, "hard", 1.5)


# ------------------------------------------------------------------------------------------------ #
# The distillation token and head
# ------------------------------------------------------------------------------------------------ #


def distilled_vit(**kw):
    torch.manual_seed(0)
    args = dict(image_size=32, patch_size=8, depth=2, width=32, num_heads=2, mlp_dim=64)
    return VisionTransformer(**{**args, "num_classes": 10, "dist_token": True, **kw})


def test_token_and_head_outputs_by_mode():
    model = distilled_vit(head_init_scale=1.0)
    plain_names = {n for n, _ in distilled_vit(dist_token=False).named_parameters()}
    names = {n for n, _ in model.named_parameters()}
    assert names - plain_names == {"dist_token", "head_dist.weight", "head_dist.bias"}
    assert model.pos_embed.shape[1] == 2 + 16 and model.num_prefix_tokens == 2
    x = torch.randn(3, 3, 32, 32)
    model.train()
    averaged = model(x)  # not in distilled training: the mean of the heads, as timm fine-tunes
    model.set_distilled_training(True)
    cls, dist = model(x)
    assert not torch.equal(cls, dist)
    torch.testing.assert_close(averaged, (cls + dist) / 2)
    model.eval()
    torch.testing.assert_close(model(x), (cls + dist) / 2)
    with pytest.raises(ValueError, match="dist_token"):
        distilled_vit(dist_token=False).set_distilled_training(True)
    cx = model.complexity()
    assert cx["params"] == sum(p.numel() for p in model.parameters())


def test_pooled_classifier_and_registers_keep_the_token_apart():
    model = distilled_vit(classifier="pooled", class_token=False, num_registers=2).eval()
    assert model.dist_index == 0 and model.num_prefix_tokens == 3
    tokens = model.forward_features(torch.randn(2, 3, 32, 32))
    normed = model.norm(tokens)
    cls = model.head(normed[:, 3:].mean(1))
    dist = model.head_dist(normed[:, 0])
    torch.testing.assert_close(model.forward_head(tokens), (cls + dist) / 2)


@pytest.fixture(scope="module")
def timm():
    return pytest.importorskip("timm")


@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
def test_timm_distilled_deit_round_trip(timm, tmp_path, layout):
    """timm's VisionTransformerDistilled -> pycls -> a timm export that timm alone loads: the same
    logits in eval mode, and the same pair of heads in distilled training."""
    theirs = timm.create_model(
        "deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8,
        embed_dim=48, depth=2, num_heads=3, num_classes=7,
    ).eval()  # fmt: skip
    with torch.no_grad():  # timm's init leaves the heads at zero: give them weights
        for head in (theirs.head, theirs.head_dist):
            head.weight.normal_(std=0.1)
    ours = from_timm(theirs, layout=layout).eval()
    assert ours.arch["dist_token"] and ours.head_dist is not None
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    theirs.train().set_distilled_training(True)
    ours.train().set_distilled_training(True)
    for a, b in zip(ours(x), theirs(x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # export: timm builds it from the file's metadata alone, strict load, same logits
    path = weight_files.export_model(ours.eval(), "", "timm", str(tmp_path / "d.safetensors"))
    assert weight_files.read_metadata(path)["timm_model"] == convert.TIMM_DISTILLED_MODEL_NAME
    again = weight_files.timm_model_from_export(path)
    assert type(again).__name__ == "VisionTransformerDistilled"
    torch.testing.assert_close(again(x), ours(x), rtol=1e-5, atol=1e-5)


def test_what_timm_cannot_hold_is_refused(tmp_path):
    for kw, what in [(dict(classifier="pooled"), "pooled"), (dict(num_registers=1), "registers"),
                     (dict(fc_norm=True), "fc_norm")]:  # fmt: skip
        with pytest.raises(weight_files.WeightsError, match=what):
            weight_files.export_model(distilled_vit(**kw), "", "timm", str(tmp_path / "x"))
    with pytest.raises(weight_files.WeightsError, match="dist_token"):
        weight_files.export_model(distilled_vit(), "", "torchvision", str(tmp_path / "y"))


def test_deit_weights_fine_tune_with_new_heads(timm, tmp_path):
    """A DeiT distilled checkpoint (timm naming, under "model" as DeiT saves it) as TRAIN.WEIGHTS
    of a distilled ViT with other classes: both heads are dropped and made anew."""
    theirs = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32,
                               patch_size=8, embed_dim=48, depth=2, num_heads=3)  # fmt: skip
    path = str(tmp_path / "deit.pth")
    torch.save({"model": theirs.state_dict()}, path)
    ours = distilled_vit(width=48, num_heads=3, mlp_dim=192, num_classes=5)
    weight_files.load_weights(path, ours)
    torch.testing.assert_close(ours.dist_token, theirs.dist_token)
    assert ours.head_dist.weight.shape == (5, 48)


# ------------------------------------------------------------------------------------------------ #
# The teacher
# ------------------------------------------------------------------------------------------------ #


def test_teacher_runs_in_eval_mode_under_the_runs_autocast_without_gradients():
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
    net.num_classes = 3
    x = torch.randn(5, 6)
    teacher = Teacher(net, "cpu", Precision("O1", "bfloat16", "cpu"))
    assert not teacher.module.training and not any(p.requires_grad for p in net.parameters())
    with torch.enable_grad():
        out = teacher(x)
    assert out.dtype == torch.float32 and not out.requires_grad
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = net.eval()(x).float()  # dropout off, bfloat16 matmuls
    assert torch.equal(out, expected) and not torch.equal(out, net(x).float())
    o2 = Teacher(net, "cpu", Precision("O2", "bfloat16", "cpu"))
    assert o2.module[0].weight.dtype == torch.bfloat16  # cast as the student is


def _quickstart(out_dir, *overrides):
    return config.load_cfg(QUICKSTART, [*TINY, "OUT_DIR", str(out_dir), *overrides])


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A tiny ViT trained 1 epoch on the digits: a pycls checkpoint to distil from."""
    out = tmp_path_factory.mktemp("teacher")
    train_model(_quickstart(out, "OPTIM.MAX_EPOCH", "1", "TRAIN.EVAL_PERIOD", "1"))
    return out


DISTILL = ["VIT.DIST_TOKEN", "True", "DISTILL.TYPE", "hard", "DISTILL.ALPHA", "0.5"]


def test_teacher_is_outside_the_engine_and_its_state(teacher_run, tmp_path):
    teacher = str(teacher_run / "model_final.safetensors")
    cfg = _quickstart(tmp_path, *DISTILL, "DISTILL.TEACHER", teacher, "TRAIN.EMA", "True")
    engine, optimizer, scaler, loss_fn, _ = build_training(cfg, torch.device("cpu"))
    step = builders.build_training_step(cfg, engine, optimizer, scaler, loss_fn)
    teacher = step.teacher.module
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in trained for p in teacher.parameters())
    assert not any(t is p for t in teacher.parameters() for p in engine.module.parameters())
    assert {"dist_token", "head_dist.weight"} <= set(engine.module.state_dict())
    assert set(step.ema.names) == {n for n, _ in engine.module.named_parameters()} | {"pos_embed"}
    images = torch.randn(8, 3, 16, 16)
    labels = torch.randint(0, 10, (8,))
    batches = iter([(images, labels, 0)])
    before = [p.detach().clone() for p in teacher.parameters()]
    step(batches, 1e-3, meter=None)
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))
    assert all(p.grad is None for p in teacher.parameters()) and not teacher.training


def test_config_errors_name_the_key(teacher_run, tmp_path):
    for overrides, match in [
        (["DISTILL.TYPE", "hard"], "DISTILL.TEACHER: DISTILL.TYPE hard needs a teacher"),
        (["DISTILL.TYPE", "soft", "DISTILL.TEACHER", "zoo:RegNetY-17GF"], "DISTILL.TEACHER: 'Reg"),
        (["DISTILL.TYPE", "hard", "DISTILL.TEACHER", "timm:regnety_160"], "TEACHER_WEIGHTS"),
        (["DISTILL.TYPE", "hard", "DISTILL.TEACHER", "x", "TRAIN.PARALLEL", "pipeline"],
         "DISTILL.TYPE: cannot be used with TRAIN.PARALLEL pipeline"),
        # tried on 2 gloo processes: the group's gathered batch against the teacher's shard
        (["DISTILL.TYPE", "hard", "DISTILL.TEACHER", "x", "TRAIN.PARALLEL", "tensor"],
         "DISTILL.TYPE: cannot be used with TRAIN.PARALLEL tensor"),
        # tried: the pipeline's stages and the tensor plan leave the token and its head out
        (["VIT.DIST_TOKEN", "True", "TRAIN.PARALLEL", "pipeline"],
         "VIT.DIST_TOKEN: cannot be used with TRAIN.PARALLEL pipeline"),
        (["VIT.DIST_TOKEN", "True", "TRAIN.PARALLEL", "tensor"],
         "VIT.DIST_TOKEN: cannot be used with TRAIN.PARALLEL tensor"),
        (["DISTILL.ALPHA", "1.5"], "DISTILL.ALPHA"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            _quickstart(tmp_path, *overrides)
    for teacher, match in [
        (str(tmp_path / "none.pyth"), "does not exist"),
        (str(teacher_run / "model_final.safetensors"), "predicts 10 classes"),
    ]:
        cfg = _quickstart(tmp_path, *DISTILL, "DISTILL.TEACHER", teacher, "MODEL.NUM_CLASSES", "12")
        with pytest.raises(ConfigError, match=f"DISTILL.TEACHER: .*{match}"):
            builders.build_teacher(cfg, torch.device("cpu"), Precision())


def test_zoo_teacher_from_the_weights_folder(tmp_path):
    """zoo:NAME reads the published file from MODEL.ZOO_DIR (here a stand-in of the same
    architecture), as TRAIN.WEIGHTS zoo:NAME does; without it, one line says where it goes."""
    from pycls.models import zoo

    net = zoo.build_model("RegNetX-200MF")
    published = {"epoch": 100, "model_state": net.state_dict()}  # upstream pycls's layout
    torch.save(published, zoo.weights_path("RegNetX-200MF", str(tmp_path)))
    cfg = _quickstart(tmp_path, "DISTILL.TYPE", "soft", "DISTILL.TEACHER", "zoo:RegNetX-200MF",
                      "MODEL.ZOO_DIR", str(tmp_path), "MODEL.NUM_CLASSES", "1000")  # fmt: skip
    teacher = builders.build_teacher(cfg, torch.device("cpu"), Precision())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(teacher(x), net.eval()(x))
    empty = tmp_path / "empty"
    cfg = _quickstart(tmp_path, "DISTILL.TYPE", "soft", "DISTILL.TEACHER", "zoo:RegNetX-200MF",
                      "MODEL.ZOO_DIR", str(empty), "MODEL.NUM_CLASSES", "1000")  # fmt: skip
    with pytest.raises(ConfigError, match=f"DISTILL.TEACHER: .*{empty}"):
        builders.build_teacher_module(cfg)


def test_timm_teacher_with_a_deit_style_weights_file(timm, tmp_path):
    net = timm.create_model("resnet18", pretrained=False, num_classes=10)
    path = str(tmp_path / "teacher.pth")
    torch.save({"model": net.state_dict()}, path)  # DeiT's teacher file layout
    cfg = _quickstart(tmp_path, "DISTILL.TYPE", "hard", "DISTILL.TEACHER", "timm:resnet18",
                      "DISTILL.TEACHER_WEIGHTS", path)  # fmt: skip
    teacher = builders.build_teacher(cfg, torch.device("cpu"), Precision())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(teacher(x), net.eval()(x))


# ------------------------------------------------------------------------------------------------ #
# Training with a teacher
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.slow
def test_distilled_training_resumes_exactly_and_saves_no_teacher(teacher_run, tmp_path):
    teacher = str(teacher_run / "model_final.safetensors")
    common = [*DISTILL, "DISTILL.TEACHER", teacher, "OPTIM.MAX_EPOCH", "2"]
    common += ["TRAIN.EVAL_PERIOD", "1", "TRAIN.CHECKPOINT_PERIOD", "1", "MIXUP.ALPHA", "0.8"]
    full, part = tmp_path / "full", tmp_path / "part"
    stats = train_model(_quickstart(full, *common))
    assert stats["top1_err"] < 90  # evaluation runs the averaged heads
    resume_from(full, part, 1)
    train_model(_quickstart(part, *common))
    assert json_stats_of(part, "resume")[-1]["epoch"] == 1
    a = weight_files.read_weights(str(full / "model_final.safetensors"))
    b = weight_files.read_weights(str(part / "model_final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "dist_token" in a and not any(k.startswith(("teacher", "stem.")) for k in a)
    state = sharded.read_state(os.path.join(full, "checkpoints", "model_epoch_0002.pyth"))
    assert set(state["model_state"]) == set(a)


@pytest.mark.slow
def test_soft_distillation_trains_a_cnn_student_and_time_mode_runs(teacher_run, tmp_path):
    """Any student: the quickstart RegNet's one head takes both terms; --mode time times the
    step with the teacher in it."""
    from pycls.core.benchmark import time_model

    teacher = str(teacher_run / "model_final.safetensors")
    cfg = config.load_cfg(
        os.path.join(ROOT, "configs", "quickstart_regnet.yaml"),
        ["AMP.CPU_LEVEL", "same", "OUT_DIR", str(tmp_path), "OPTIM.MAX_EPOCH", "1",
         "TRAIN.BATCH_SIZE", "64", "DISTILL.TYPE", "soft", "DISTILL.TEACHER", teacher,
         "DISTILL.TAU", "2.0"],
    )  # fmt: skip
    train_model(cfg)
    cfg = _quickstart(tmp_path / "t", *DISTILL, "DISTILL.TEACHER", teacher, "AMP.LEVEL", "O1",
                      "PREC_TIME.NUM_ITER", "2", "PREC_TIME.WARMUP_ITER", "1")  # fmt: skip
    assert time_model(cfg)["train_step_time"] > 0


# ------------------------------------------------------------------------------------------------ #
# DDP and FSDP2 on 2 gloo processes against one process, each process holding the teacher
# ------------------------------------------------------------------------------------------------ #

ENGINES = {"ddp": ["TRAIN.PARALLEL", "ddp"], "fsdp": ["TRAIN.PARALLEL", "fsdp"]}


def _distill_cfg(teacher, *overrides):

    return tiny_cfg(*DISTILL, "DISTILL.TEACHER", teacher, "DISTILL.TYPE", "soft", *overrides)


def _distilled_steps(cfg, rank=0, world=1):
    """5 training steps (the trainer's TrainingStep, teacher included) of this process's share
    of fixed global batches; (engine, global mean losses)."""

    torch.manual_seed(distributed.get_rank())  # ranks differ; engines start from rank 0's
    engine, optimizer, scaler, loss_fn, _ = build_training(cfg, torch.device("cpu"))
    step = builders.build_training_step(cfg, engine, optimizer, scaler, loss_fn)
    losses = []
    for images, labels in batches(cfg):
        shard = images.shape[0] // world
        mine = slice(rank * shard, (rank + 1) * shard)
        [((loss, _), n)] = step(iter([(images[mine], labels[mine], 0)]), 1e-3)
        total = loss.detach() * n
        distributed.all_reduce_sum([total])
        losses.append(float(total) / (shard * world))
    return engine, losses


def _distill_worker(rank, world, port, teacher, out_dir):

    _init(rank, world, port)
    try:
        results = {}
        for name, overrides in ENGINES.items():
            engine, losses = _distilled_steps(_distill_cfg(teacher, *overrides), rank, world)
            results[name] = {"losses": losses, "weights": engine.full_state_dict()}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "distill.pt"))
    finally:
        distributed.destroy_process_group()


@pytest.fixture(scope="module")
def small_teacher(tmp_path_factory):
    """The tiny engine test ViT (no distillation token), randomly initialised, saved as a pycls
    model_final.safetensors with its config."""

    out = tmp_path_factory.mktemp("small_teacher")
    cfg = tiny_cfg("VIT.DEPTH", "2")
    torch.manual_seed(5)
    model = builders.build_model(cfg)
    path = str(out / "model_final.safetensors")
    weight_files.save_safetensors(model.state_dict(), path, {"naming": "pycls", "cfg": cfg.dump()})
    return path


@pytest.mark.slow
def test_ddp_and_fsdp_with_a_teacher_match_one_process(small_teacher, tmp_path):

    spawn(_distill_worker, 2, small_teacher, str(tmp_path))
    got = torch.load(str(tmp_path / "distill.pt"), weights_only=False)
    engine, losses = _distilled_steps(_distill_cfg(small_teacher))
    ref = engine.module.state_dict()
    assert "head_dist.weight" in ref
    for name in ENGINES:
        torch.testing.assert_close(
            torch.tensor(got[name]["losses"]), torch.tensor(losses), rtol=LOSS_RTOL, atol=0
        )
        assert_weights_close(got[name]["weights"], ref, atol=WEIGHT_ATOL)
