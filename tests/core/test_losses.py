"""MODEL.LOSS_FUN binary_cross_entropy (pycls.core.losses) against torch's BCEWithLogitsLoss and
timm's BinaryCrossEntropy on the same batch, as DeiT III uses it (mixup's targets binarised with
``targets.gt(0)``); its config checks; distillation over it; a run that trains with it."""

import pytest
import torch
import torch.nn.functional as F
from timm.loss import BinaryCrossEntropy as TimmBCE

from pycls.config import ConfigError
from pycls.core import trainer
from pycls.core.builders import build_loss_fn
from pycls.core.distillation import DistillationLoss
from pycls.core.losses import BinaryCrossEntropy
from pycls.datasets.loading.transforms import BatchMixer
from tests.helpers import json_stats_of, tiny_quickstart

CLASSES = 10


def batch(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, CLASSES, generator=g) * 3
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return logits, labels


def mixed_targets(labels, seed=0):
    """Mixup and cutmix targets as the trainer's mixer makes them (soft, two classes each)."""
    torch.manual_seed(seed)
    images = torch.randn(labels.numel(), 3, 8, 8)
    mixer = BatchMixer(CLASSES, mixup_alpha=0.8, cutmix_alpha=1.0)
    return mixer(images, labels)[1]


def test_deit3_targets_are_torchs_bce_of_mixups_targets_binarised():
    """DeiT III: criterion BCEWithLogitsLoss on ``targets.gt(0.0)`` of mixup's targets (both
    classes of a mixed image 1). Caught: thresholding after smoothing were skipped (soft targets:
    a loss 0.05 lower), a sum over classes instead of the mean."""
    logits, labels = batch()
    targets = mixed_targets(labels)
    assert (targets.gt(0).sum(1) == 2).any()  # mixed images present
    want = torch.nn.BCEWithLogitsLoss()(logits, targets.gt(0.0).to(targets.dtype))
    torch.testing.assert_close(BinaryCrossEntropy(0.0, 0.0)(logits, targets), want)
    hard = torch.nn.BCEWithLogitsLoss()(logits, F.one_hot(labels, CLASSES).float())
    torch.testing.assert_close(BinaryCrossEntropy(0.0, 0.0)(logits, labels), hard)


@pytest.mark.parametrize("smoothing, threshold", [(0.0, None), (0.1, None), (0.1, 0.2), (0.0, 0.0)])
def test_bce_is_timms_with_the_same_options(smoothing, threshold):
    """Class indices: timm's BinaryCrossEntropy(smoothing, target_threshold) one-hot encodes and
    smooths them as pycls does. Soft targets: timm leaves the smoothing to its Mixup
    (label_smoothing), which smooths each class's one-hot target before mixing: the same affine
    map pycls applies after. Caught: smoothing as s instead of s / classes for the zeros."""
    logits, labels = batch(1)
    ours = BinaryCrossEntropy(smoothing, threshold)
    timm = TimmBCE(smoothing=smoothing, target_threshold=threshold)
    torch.testing.assert_close(ours(logits, labels), timm(logits, labels))
    soft = mixed_targets(labels, seed=1)
    smoothed = soft * (1 - smoothing) + smoothing / CLASSES  # timm's Mixup(label_smoothing)
    torch.testing.assert_close(ours(logits, soft), timm(logits, smoothed))


def test_the_builder_reads_the_loss_keys(tmp_path):
    """MODEL.LOSS_FUN, TRAIN.LABEL_SMOOTHING and MODEL.BCE_TARGET_THRESHOLD (negative: soft)."""
    bce = ("MODEL.LOSS_FUN", "binary_cross_entropy")
    loss = build_loss_fn(tiny_quickstart(tmp_path, *bce, "TRAIN.LABEL_SMOOTHING", "0.0"))
    assert isinstance(loss, BinaryCrossEntropy)
    assert (loss.smoothing, loss.target_threshold) == (0.0, 0.0)  # DeiT III's
    cfg = tiny_quickstart(tmp_path, *bce, "MODEL.BCE_TARGET_THRESHOLD", "0.2")
    assert (build_loss_fn(cfg).smoothing, build_loss_fn(cfg).target_threshold) == (0.1, 0.2)
    cfg = tiny_quickstart(tmp_path, *bce, "MODEL.BCE_TARGET_THRESHOLD", "-1.0")
    assert build_loss_fn(cfg).target_threshold is None
    assert isinstance(build_loss_fn(tiny_quickstart(tmp_path)), torch.nn.CrossEntropyLoss)


def test_a_threshold_that_cannot_part_the_smoothed_targets_is_refused(tmp_path):
    """Smoothing 0.1 over 10 classes makes every 0 a 0.01: DeiT III's threshold 0 would make
    every target 1. Refused in one line naming the key and the smoothing."""
    bce = ("MODEL.LOSS_FUN", "binary_cross_entropy")
    with pytest.raises(ConfigError, match=r"^MODEL.BCE_TARGET_THRESHOLD: .*LABEL_SMOOTHING 0.1"):
        tiny_quickstart(tmp_path, *bce, "TRAIN.LABEL_SMOOTHING", "0.1")
    with pytest.raises(ConfigError, match=r"^MODEL.BCE_TARGET_THRESHOLD: "):
        tiny_quickstart(tmp_path, *bce, "MODEL.BCE_TARGET_THRESHOLD", "0.95")
    tiny_quickstart(tmp_path, *bce, "MODEL.BCE_TARGET_THRESHOLD", "0.05")  # in between: fine


def test_distillation_over_bce_weighs_its_terms_as_deit():
    """DeiT's DistillationLoss with a BCE base: (1 - alpha) BCE(class head) + alpha CE(teacher's
    top class). Caught: the base not called with the targets."""
    logits, labels = batch(2)
    dist_logits, teacher = batch(3)[0], batch(4)[0]
    base = BinaryCrossEntropy(0.0, 0.0)
    got = DistillationLoss(base, "hard", alpha=0.5)((logits, dist_logits), teacher, labels)
    want = 0.5 * base(logits, labels) + 0.5 * F.cross_entropy(dist_logits, teacher.argmax(1))
    torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_a_run_trains_with_bce_and_three_augment(tmp_path):
    """Two epochs of the tiny quickstart with DeiT III's loss, mixup and cutmix, and
    3-Augment: the meters log the same fields as under cross-entropy and the error falls."""
    cfg = tiny_quickstart(
        tmp_path, "MODEL.LOSS_FUN", "binary_cross_entropy", "TRAIN.LABEL_SMOOTHING", "0.0",
        "TRAIN.AUGMENT", "three_augment", "MIXUP.ALPHA", "0.8", "MIXUP.CUTMIX_ALPHA", "1.0",
        "OPTIM.MAX_EPOCH", "2", "TRAIN.EVAL_PERIOD", "1", "OPTIM.WARMUP_EPOCHS", "0",
    )  # fmt: skip
    trainer.train_model(cfg)
    tests = json_stats_of(tmp_path, "test_epoch")
    assert {"loss", "top1_err", "top5_err"} <= set(tests[-1])
    assert tests[-1]["top1_err"] < 90.0  # chance is 90 % on ten digits
