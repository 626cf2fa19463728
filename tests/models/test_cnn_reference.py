"""The CNN zoo against reference implementations and upstream's checkpoint layout.

- ResNet-50 (upstream's zoo AnyNet) holds torchvision's resnet50 weights, renamed, and gives the
  same logits; RegNetX-200MF / RegNetY-800MF the same with timm's regnetx_002 / regnety_008
  (timm's RegNets follow pycls, including its weights).
- Checkpoints written here in upstream pycls's layout ({"model_state", "ema_state",
  "optimizer_state", "test_err", "ema_err", "cfg", "epoch"}, no checksum) load strictly into
  RegNetY, ResNet and EfficientNet through ``pretrained=PATH``, the zoo's cache folder and
  TRAIN.WEIGHTS, taking the better of the model and EMA weights, with the same logits.
"""

import re
import urllib.request

import pytest
import torch
from torch import nn

from pycls import models
from pycls.checkpoint import weight_files
from pycls.models import zoo

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

ATOL = 1e-5


def randomize_bn(model, seed=0):
    """Non-trivial batch-norm statistics and affine parameters (fresh ones are 0/1)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
    return model


def logits(model, images):
    with torch.no_grad():
        return model.eval()(images)


# ---- torchvision ResNet-50 ----------------------------------------------------------------------

_TV_BLOCK = {"f.a.": "conv1.", "f.a_bn.": "bn1.", "f.b.": "conv2.", "f.b_bn.": "bn2."}
_TV_BLOCK.update(
    {"f.c.": "conv3.", "f.c_bn.": "bn3.", "proj.": "downsample.0.", "bn.": "downsample.1."}
)


def ours_to_torchvision_resnet(key):
    if key.startswith("stem."):
        return key.replace("stem.conv.", "conv1.").replace("stem.bn.", "bn1.")
    if key.startswith("head.fc."):
        return key.replace("head.fc.", "fc.")
    stage, block, rest = re.match(r"s(\d)\.b(\d+)\.(.*)", key).groups()
    for ours, theirs in _TV_BLOCK.items():
        if rest.startswith(ours):
            rest = theirs + rest[len(ours) :]
            break
    return f"layer{stage}.{int(block) - 1}.{rest}"


def test_resnet50_matches_torchvision():
    import torchvision

    torch.manual_seed(0)
    tv = randomize_bn(torchvision.models.resnet50())
    ours = models.resnet("50")
    tv_state = tv.state_dict()
    state = {k: tv_state[ours_to_torchvision_resnet(k)] for k in ours.state_dict()}
    assert len(state) == len(tv_state)  # the mapping is one-to-one
    ours.load_state_dict(state, strict=True)
    images = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(logits(ours, images), logits(tv, images), atol=ATOL, rtol=0)


# ---- timm RegNets -------------------------------------------------------------------------------

_TIMM_BLOCK = {"f.a.": "conv1.conv.", "f.a_bn.": "conv1.bn.", "f.b.": "conv2.conv."}
_TIMM_BLOCK.update({"f.b_bn.": "conv2.bn.", "f.se.f_ex.0.": "se.fc1.", "f.se.f_ex.2.": "se.fc2."})
_TIMM_BLOCK.update({"f.c.": "conv3.conv.", "f.c_bn.": "conv3.bn.", "proj.": "downsample.conv."})
_TIMM_BLOCK.update({"bn.": "downsample.bn."})


def ours_to_timm_regnet(key):
    match = re.match(r"(s\d\.b\d+)\.(.*)", key)
    if not match:
        return key  # stem.conv, stem.bn, head.fc: the same names
    prefix, rest = match.groups()
    for ours, theirs in _TIMM_BLOCK.items():
        if rest.startswith(ours):
            return f"{prefix}.{theirs}{rest[len(ours) :]}"
    raise AssertionError(key)


@pytest.mark.parametrize(
    "ours_name, timm_name", [("RegNetX-200MF", "regnetx_002"), ("RegNetY-800MF", "regnety_008")]
)
def test_regnet_matches_timm(ours_name, timm_name):
    import timm

    torch.manual_seed(0)
    ref = randomize_bn(timm.create_model(timm_name, pretrained=False))
    ours = models.build_model(ours_name)
    ref_state = ref.state_dict()
    state = {k: ref_state[ours_to_timm_regnet(k)] for k in ours.state_dict()}
    assert len(state) == len(ref_state)
    ours.load_state_dict(state, strict=True)
    images = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(logits(ours, images), logits(ref, images), atol=ATOL, rtol=0)
    assert ours.complexity()["params"] == sum(p.numel() for p in ref.parameters())


# ---- upstream-layout checkpoints ----------------------------------------------------------------

CHECKPOINT_MODELS = ["RegNetY-200MF", "ResNet-50", "EfficientNet-B0"]


def write_upstream_checkpoint(path, model, ema_model, test_err, ema_err):
    """A file in upstream pycls's layout, as its trainer writes it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.save(
        {
            "epoch": 99,
            "test_err": test_err,
            "ema_err": ema_err,
            "model_state": model.state_dict(),
            "ema_state": ema_model.state_dict(),
            "optimizer_state": optimizer.state_dict(),
            "cfg": "MODEL:\n  TYPE: regnet\n",
        },
        path,
    )


def two_models(name):
    torch.manual_seed(1)
    model = randomize_bn(models.build_model(name), seed=1)
    ema = randomize_bn(models.build_model(name), seed=2)
    return model, ema


@pytest.mark.parametrize("name", CHECKPOINT_MODELS)
def test_upstream_checkpoint_loads_better_weights(tmp_path, name):
    model, ema = two_models(name)
    images = torch.randn(2, 3, 64, 64)
    for test_err, ema_err, expected in [
        (20.0, 21.0, model),
        (22.0, 21.5, ema),
        (21.0, 21.0, model),
    ]:
        path = tmp_path / f"{name}_{test_err}_{ema_err}.pyth"
        write_upstream_checkpoint(path, model, ema, test_err, ema_err)
        loaded = models.build_model(name, pretrained=str(path))
        torch.testing.assert_close(
            logits(loaded, images), logits(expected, images), atol=ATOL, rtol=0
        )


def test_upstream_checkpoint_without_ema_or_errors(tmp_path):
    model, _ = two_models("RegNetY-200MF")
    path = tmp_path / "old.pyth"  # upstream's oldest files: no EMA, no errors
    torch.save({"epoch": 99, "model_state": model.state_dict(), "cfg": ""}, path)
    loaded = models.regnety("200MF", pretrained=str(path))
    images = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(logits(loaded, images), logits(model, images), atol=ATOL, rtol=0)


def test_upstream_checkpoint_as_train_weights(tmp_path):
    # TRAIN.WEIGHTS goes through pycls.checkpoint.weight_files: the same file, the better weights.
    model, ema = two_models("RegNetY-200MF")
    path = tmp_path / "upstream.pyth"
    write_upstream_checkpoint(path, model, ema, test_err=25.0, ema_err=24.0)
    target = models.regnety("200MF")
    weight_files.load_weights(str(path), target)
    images = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(logits(target, images), logits(ema, images), atol=ATOL, rtol=0)
    # A new head for another number of classes, the rest loaded
    ten = models.regnety("200MF", num_classes=10)
    weight_files.load_weights(str(path), ten)
    torch.testing.assert_close(ten.stem.conv.weight, ema.stem.conv.weight)


def test_upstream_checkpoint_of_another_model_is_refused(tmp_path):
    model, ema = two_models("RegNetY-200MF")
    path = tmp_path / "upstream.pyth"
    write_upstream_checkpoint(path, model, ema, test_err=25.0, ema_err=24.0)
    with pytest.raises(RuntimeError, match="size mismatch|Missing key|Unexpected key"):
        models.regnetx("200MF", pretrained=str(path))
    with pytest.raises(weight_files.WeightsError, match="does not fit"):
        weight_files.load_weights(str(path), models.regnetx("200MF"))


def test_pretrained_from_cache_folder(tmp_path, monkeypatch):
    model, ema = two_models("RegNetY-200MF")
    cache = tmp_path / "zoo"
    cache.mkdir()
    path = cache / "RegNetY-200MF_dds_8gpu.pyth"  # the published file's name
    write_upstream_checkpoint(path, model, ema, test_err=20.0, ema_err=30.0)
    assert zoo.weights_path("RegNetY-200MF", str(cache)) == str(path)

    def no_network(*args, **kwargs):
        raise AssertionError("the cached file must be used")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    images = torch.randn(1, 3, 64, 64)
    for loaded in (
        models.regnety("200MF", pretrained=True, cache_dir=str(cache)),
        models.build_model("RegNetY-200MF", pretrained=True, cache_dir=str(cache)),
    ):
        torch.testing.assert_close(logits(loaded, images), logits(model, images), atol=ATOL, rtol=0)
    monkeypatch.setenv(zoo.ENV_CACHE_DIR, str(cache))  # the environment variable instead
    loaded = models.regnety("RegNetY-200MF", pretrained=True)
    torch.testing.assert_close(logits(loaded, images), logits(model, images), atol=ATOL, rtol=0)


def test_pretrained_offline_gives_one_line(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(models.PretrainedWeightsUnavailable) as info:
        models.resnext("50", pretrained=True, cache_dir=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message
    url = "https://dl.fbaipublicfiles.com/pycls/dds_baselines/161167411/X-50-32x4d_dds_8gpu.pyth"
    assert url in message
    assert str(tmp_path / "X-50-32x4d_dds_8gpu.pyth") in message
    assert list(tmp_path.iterdir()) == []  # no partial file left behind
