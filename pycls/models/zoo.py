"""The model zoo of upstream pycls ("Designing Network Design Spaces" baselines): RegNetX,
RegNetY, ResNet, ResNeXt and EfficientNet, by upstream's names ("RegNetY-800MF", "ResNet-50").

Architectures, training image sizes, weight files and top-1 errors are upstream's published
figures (its MODEL_ZOO.md, dev/model_error.json and configs/dds_baselines, which this repository
ships rewritten in configs/dds_baselines). Upstream's ResNet and ResNeXt zoo models are AnyNets
(stem "res_stem_in", bottleneck blocks with the stride on the 3x3 conv: torchvision's layout).

Pretrained weights (``pretrained=True``) come from a local folder first, then the published
URL; without either, a one-line error names the URL and the exact path to put the file at. The
folder is the ``cache_dir`` argument, else the ``PYCLS_ZOO_DIR`` environment variable, else
``~/.cache/pycls/zoo`` (the config's MODEL.ZOO_DIR feeds ``cache_dir`` in config-driven runs).
"""

import dataclasses
import os
import shutil
import tempfile
import urllib.request

import torch
from torch import nn

from pycls.errors import UserError
from pycls.models.anynet import AnyNet
from pycls.models.effnet import EffNet
from pycls.models.regnet import RegNet
from pycls.models.upstream_weights import best_weights, is_upstream_checkpoint
from pycls.models.vit.args import VIT_SPECS
from pycls.models.vit.variants import build_vit

URL_PREFIX = "https://dl.fbaipublicfiles.com/pycls/dds_baselines"
ENV_CACHE_DIR = "PYCLS_ZOO_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "pycls", "zoo")
FAMILIES = {"regnet": RegNet, "anynet": AnyNet, "effnet": EffNet}


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One published model: its family and constructor arguments, the training image size, the
    weight file under URL_PREFIX ("<model id>/<file>") and upstream's top-1 error (%)."""

    family: str
    args: dict
    image_size: int
    weights: str
    top1_err: float


def _resnet(depths, resnext=False):
    """Upstream's ResNet (1x64d) and ResNeXt (32x4d) as AnyNet arguments."""
    return dict(
        stem_type="res_stem_in",
        stem_w=64,
        block_type="res_bottleneck_block",
        depths=depths,
        widths=(256, 512, 1024, 2048),
        strides=(1, 2, 2, 2),
        bot_muls=(0.5,) * 4 if resnext else (0.25,) * 4,
        group_ws=(4, 8, 16, 32) if resnext else (64, 128, 256, 512),
    )


def _effnet(stem_w, depths, widths, head_w):
    return dict(
        stem_w=stem_w,
        depths=depths,
        widths=widths,
        exp_ratios=(1, 6, 6, 6, 6, 6, 6),
        strides=(1, 2, 2, 2, 1, 2, 1),
        kernels=(3, 3, 5, 3, 5, 5, 3),
        head_w=head_w,
    )


# RegNetY is RegNetX with squeeze-excitation (se_r=0.25); top1_err from dev/model_error.json
ZOO = {
    "RegNetX-200MF": ZooModel(
        "regnet",
        dict(w_a=36.44, w_0=24, w_m=2.49, depth=13, group_w=8),
        224,
        "160905981/RegNetX-200MF_dds_8gpu.pyth",
        31.088,
    ),
    "RegNetX-400MF": ZooModel(
        "regnet",
        dict(w_a=24.48, w_0=24, w_m=2.54, depth=22, group_w=16),
        224,
        "160905967/RegNetX-400MF_dds_8gpu.pyth",
        27.382,
    ),
    "RegNetX-600MF": ZooModel(
        "regnet",
        dict(w_a=36.97, w_0=48, w_m=2.24, depth=16, group_w=24),
        224,
        "160906442/RegNetX-600MF_dds_8gpu.pyth",
        25.864,
    ),
    "RegNetX-800MF": ZooModel(
        "regnet",
        dict(w_a=35.73, w_0=56, w_m=2.28, depth=16, group_w=16),
        224,
        "160906036/RegNetX-800MF_dds_8gpu.pyth",
        24.846,
    ),
    "RegNetX-1.6GF": ZooModel(
        "regnet",
        dict(w_a=34.01, w_0=80, w_m=2.25, depth=18, group_w=24),
        224,
        "160990626/RegNetX-1.6GF_dds_8gpu.pyth",
        23.038,
    ),
    "RegNetX-3.2GF": ZooModel(
        "regnet",
        dict(w_a=26.31, w_0=88, w_m=2.25, depth=25, group_w=48),
        224,
        "160906139/RegNetX-3.2GF_dds_8gpu.pyth",
        21.736,
    ),
    "RegNetX-4.0GF": ZooModel(
        "regnet",
        dict(w_a=38.65, w_0=96, w_m=2.43, depth=23, group_w=40),
        224,
        "160906383/RegNetX-4.0GF_dds_8gpu.pyth",
        21.356,
    ),
    "RegNetX-6.4GF": ZooModel(
        "regnet",
        dict(w_a=60.83, w_0=184, w_m=2.07, depth=17, group_w=56),
        224,
        "161116590/RegNetX-6.4GF_dds_8gpu.pyth",
        20.844,
    ),
    "RegNetX-8.0GF": ZooModel(
        "regnet",
        dict(w_a=49.56, w_0=80, w_m=2.88, depth=23, group_w=120),
        224,
        "161107726/RegNetX-8.0GF_dds_8gpu.pyth",
        20.728,
    ),
    "RegNetX-12GF": ZooModel(
        "regnet",
        dict(w_a=73.36, w_0=168, w_m=2.37, depth=19, group_w=112),
        224,
        "160906020/RegNetX-12GF_dds_8gpu.pyth",
        20.288,
    ),
    "RegNetX-16GF": ZooModel(
        "regnet",
        dict(w_a=55.59, w_0=216, w_m=2.1, depth=22, group_w=128),
        224,
        "158460855/RegNetX-16GF_dds_8gpu.pyth",
        19.956,
    ),
    "RegNetX-32GF": ZooModel(
        "regnet",
        dict(w_a=69.86, w_0=320, w_m=2.0, depth=23, group_w=168),
        224,
        "158188473/RegNetX-32GF_dds_8gpu.pyth",
        19.498,
    ),
    "RegNetY-200MF": ZooModel(
        "regnet",
        dict(w_a=36.44, w_0=24, w_m=2.49, depth=13, group_w=8, se_r=0.25),
        224,
        "176245422/RegNetY-200MF_dds_8gpu.pyth",
        29.658,
    ),
    "RegNetY-400MF": ZooModel(
        "regnet",
        dict(w_a=27.89, w_0=48, w_m=2.09, depth=16, group_w=8, se_r=0.25),
        224,
        "160906449/RegNetY-400MF_dds_8gpu.pyth",
        25.898,
    ),
    "RegNetY-600MF": ZooModel(
        "regnet",
        dict(w_a=32.54, w_0=48, w_m=2.32, depth=15, group_w=16, se_r=0.25),
        224,
        "160981443/RegNetY-600MF_dds_8gpu.pyth",
        24.54,
    ),
    "RegNetY-800MF": ZooModel(
        "regnet",
        dict(w_a=38.84, w_0=56, w_m=2.4, depth=14, group_w=16, se_r=0.25),
        224,
        "160906567/RegNetY-800MF_dds_8gpu.pyth",
        23.684,
    ),
    "RegNetY-1.6GF": ZooModel(
        "regnet",
        dict(w_a=20.71, w_0=48, w_m=2.65, depth=27, group_w=24, se_r=0.25),
        224,
        "160906681/RegNetY-1.6GF_dds_8gpu.pyth",
        22.066,
    ),
    "RegNetY-3.2GF": ZooModel(
        "regnet",
        dict(w_a=42.63, w_0=80, w_m=2.66, depth=21, group_w=24, se_r=0.25),
        224,
        "160906834/RegNetY-3.2GF_dds_8gpu.pyth",
        21.074,
    ),
    "RegNetY-4.0GF": ZooModel(
        "regnet",
        dict(w_a=31.41, w_0=96, w_m=2.24, depth=22, group_w=64, se_r=0.25),
        224,
        "160906838/RegNetY-4.0GF_dds_8gpu.pyth",
        20.64,
    ),
    "RegNetY-6.4GF": ZooModel(
        "regnet",
        dict(w_a=33.22, w_0=112, w_m=2.27, depth=25, group_w=72, se_r=0.25),
        224,
        "160907112/RegNetY-6.4GF_dds_8gpu.pyth",
        20.11,
    ),
    "RegNetY-8.0GF": ZooModel(
        "regnet",
        dict(w_a=76.82, w_0=192, w_m=2.19, depth=17, group_w=56, se_r=0.25),
        224,
        "161160905/RegNetY-8.0GF_dds_8gpu.pyth",
        20.052,
    ),
    "RegNetY-12GF": ZooModel(
        "regnet",
        dict(w_a=73.36, w_0=168, w_m=2.37, depth=19, group_w=112, se_r=0.25),
        224,
        "160907100/RegNetY-12GF_dds_8gpu.pyth",
        19.67,
    ),
    "RegNetY-16GF": ZooModel(
        "regnet",
        dict(w_a=106.23, w_0=200, w_m=2.48, depth=18, group_w=112, se_r=0.25),
        224,
        "161303400/RegNetY-16GF_dds_8gpu.pyth",
        19.608,
    ),
    "RegNetY-32GF": ZooModel(
        "regnet",
        dict(w_a=115.89, w_0=232, w_m=2.53, depth=20, group_w=232, se_r=0.25),
        224,
        "161277763/RegNetY-32GF_dds_8gpu.pyth",
        19.066,
    ),
    "ResNet-50": ZooModel(
        "anynet",
        _resnet((3, 4, 6, 3), resnext=False),
        224,
        "161235311/R-50-1x64d_dds_8gpu.pyth",
        23.19,
    ),
    "ResNet-101": ZooModel(
        "anynet",
        _resnet((3, 4, 23, 3), resnext=False),
        224,
        "161167170/R-101-1x64d_dds_8gpu.pyth",
        21.414,
    ),
    "ResNet-152": ZooModel(
        "anynet",
        _resnet((3, 8, 36, 3), resnext=False),
        224,
        "161167467/R-152-1x64d_dds_8gpu.pyth",
        20.87,
    ),
    "ResNeXt-50": ZooModel(
        "anynet",
        _resnet((3, 4, 6, 3), resnext=True),
        224,
        "161167411/X-50-32x4d_dds_8gpu.pyth",
        21.884,
    ),
    "ResNeXt-101": ZooModel(
        "anynet",
        _resnet((3, 4, 23, 3), resnext=True),
        224,
        "161167590/X-101-32x4d_dds_8gpu.pyth",
        20.664,
    ),
    "ResNeXt-152": ZooModel(
        "anynet",
        _resnet((3, 8, 36, 3), resnext=True),
        224,
        "162471172/X-152-32x4d_dds_8gpu.pyth",
        20.386,
    ),
    "EfficientNet-B0": ZooModel(
        "effnet",
        _effnet(32, (1, 2, 2, 3, 3, 4, 1), (16, 24, 40, 80, 112, 192, 320), 1280),
        224,
        "161305613/EN-B0_dds_8gpu.pyth",
        24.92,
    ),
    "EfficientNet-B1": ZooModel(
        "effnet",
        _effnet(32, (2, 3, 3, 4, 4, 5, 2), (16, 24, 40, 80, 112, 192, 320), 1280),
        240,
        "161304979/EN-B1_dds_8gpu.pyth",
        24.068,
    ),
    "EfficientNet-B2": ZooModel(
        "effnet",
        _effnet(32, (2, 3, 3, 4, 4, 5, 2), (16, 24, 48, 88, 120, 208, 352), 1408),
        260,
        "161305015/EN-B2_dds_8gpu.pyth",
        23.518,
    ),
    "EfficientNet-B3": ZooModel(
        "effnet",
        _effnet(40, (2, 3, 3, 5, 5, 6, 2), (24, 32, 48, 96, 136, 232, 384), 1536),
        300,
        "161305060/EN-B3_dds_8gpu.pyth",
        22.47,
    ),
    "EfficientNet-B4": ZooModel(
        "effnet",
        _effnet(48, (2, 4, 4, 6, 6, 8, 2), (24, 32, 56, 112, 160, 272, 448), 1792),
        380,
        "161305098/EN-B4_dds_8gpu.pyth",
        21.374,
    ),
    "EfficientNet-B5": ZooModel(
        "effnet",
        _effnet(48, (3, 5, 5, 7, 7, 9, 3), (24, 40, 64, 128, 176, 304, 512), 2048),
        456,
        "161305138/EN-B5_dds_8gpu.pyth",
        21.674,
    ),
}
PREFIXES = {
    "regnetx": "RegNetX-",
    "regnety": "RegNetY-",
    "resnet": "ResNet-",
    "resnext": "ResNeXt-",
    "effnet": "EfficientNet-",
}


class PretrainedWeightsUnavailable(UserError, FileNotFoundError):
    """The published weights are neither in the local folder nor downloadable; the message (one
    line) names the URL and the path to put the file at (a missing input: exit status 2)."""


def list_models() -> list[str]:
    """Every name ``build_model`` accepts: the CNN zoo's, then the ViT variants."""
    return list(ZOO) + sorted(VIT_SPECS)


def weights_url(name: str) -> str:
    return f"{URL_PREFIX}/{_entry(name).weights}"


def weights_path(name: str, cache_dir: str | None = None) -> str:
    """Where the published weights of ``name`` are looked for (and downloaded to)."""
    folder = cache_dir or os.environ.get(ENV_CACHE_DIR) or DEFAULT_CACHE_DIR
    return os.path.join(os.path.expanduser(folder), os.path.basename(_entry(name).weights))


def _entry(name: str) -> ZooModel:
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; pycls.models.list_models() lists the zoo")
    return ZOO[name]


def _download(url: str, path: str) -> None:
    """``url`` to ``path`` through a temporary file in the same folder (never a partial file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=30) as response:
            shutil.copyfileobj(response, out)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fetch_weights(name: str, cache_dir: str | None = None) -> str:
    """The local path of the published weights of ``name``, downloading them if needed."""
    path, url = weights_path(name, cache_dir), weights_url(name)
    if os.path.isfile(path):
        return path
    try:
        _download(url, path)
    except OSError as e:  # no network, refused, not found: say where the file goes instead
        reason = getattr(e, "reason", None) or e
        raise PretrainedWeightsUnavailable(
            f"{name}: pretrained weights are not at {path} and cannot be downloaded from {url} "
            f"({reason}); download that URL and save it as {path} (or set {ENV_CACHE_DIR})"
        ) from None
    return path


def load_pretrained(model: nn.Module, path: str) -> None:
    """Loads a weights file into ``model`` strictly: an upstream checkpoint (its better weights),
    a checkpoint of ours (its ``model_state``) or a plain state dict."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if is_upstream_checkpoint(obj):
        state = best_weights(obj, path)
    elif isinstance(obj, dict) and isinstance(obj.get("model_state"), dict):
        state = obj["model_state"]
    else:
        state = obj
    model.load_state_dict(state, strict=True)


def build_model(name: str, pretrained: bool | str = False, num_classes: int | None = None, **kw):
    """The zoo model ``name`` ("RegNetY-800MF", "ResNet-50", ... or a ViT name such as
    "vit_b16"); ``pretrained``: True for the published ImageNet weights, a path for a weights
    file (an upstream or pycls checkpoint, or a state dict); ``num_classes``: a new classifier
    (freshly initialised, after the pretrained weights are loaded); ``kw``: other constructor
    arguments (e.g. ``bn_momentum``, ``dc_ratio``, ``cache_dir`` for pretrained=True)."""
    cache_dir = kw.pop("cache_dir", None)
    if name not in ZOO:
        if name in VIT_SPECS:
            if pretrained:
                raise ValueError(f"{name}: the zoo publishes no weights for the ViTs")
            return build_vit(name, **({"num_classes": num_classes} if num_classes else {}), **kw)
        _entry(name)  # raises, naming the list
    entry = ZOO[name]
    model = FAMILIES[entry.family](**entry.args, **kw)
    if pretrained:
        path = fetch_weights(name, cache_dir) if pretrained is True else str(pretrained)
        load_pretrained(model, path)
    if num_classes is not None and num_classes != model.num_classes:
        reset_classifier(model, num_classes)
    return model


def reset_classifier(model: nn.Module, num_classes: int) -> None:
    """A new classifier for ``num_classes``, initialised as the CNN families initialise it."""
    old = model.head.fc
    fc = nn.Linear(old.in_features, num_classes, device=old.weight.device)
    nn.init.normal_(fc.weight, mean=0.0, std=0.01)
    nn.init.zeros_(fc.bias)
    model.head.fc = fc
    if hasattr(model, "arch"):
        model.arch["num_classes"] = num_classes


def _full_name(family: str, name: str) -> str:
    prefix = PREFIXES[family]
    return name if name.startswith(prefix) else prefix + name


def regnetx(name: str, pretrained: bool | str = False, num_classes: int | None = None, **kw):
    """RegNetX by size ("800MF" or "RegNetX-800MF"); see ``build_model``."""
    return build_model(_full_name("regnetx", name), pretrained, num_classes, **kw)


def regnety(name: str, pretrained: bool | str = False, num_classes: int | None = None, **kw):
    """RegNetY by size ("800MF" or "RegNetY-800MF"); see ``build_model``."""
    return build_model(_full_name("regnety", name), pretrained, num_classes, **kw)


def resnet(name: str, pretrained: bool | str = False, num_classes: int | None = None, **kw):
    """ResNet by depth ("50" or "ResNet-50"); see ``build_model``."""
    return build_model(_full_name("resnet", name), pretrained, num_classes, **kw)


def resnext(name: str, pretrained: bool | str = False, num_classes: int | None = None, **kw):
    """ResNeXt 32x4d by depth ("101" or "ResNeXt-101"); see ``build_model``."""
    return build_model(_full_name("resnext", name), pretrained, num_classes, **kw)


def effnet(name: str, pretrained: bool | str = False, num_classes: int | None = None, **kw):
    """EfficientNet by size ("B0" or "EfficientNet-B0"); see ``build_model``."""
    return build_model(_full_name("effnet", name), pretrained, num_classes, **kw)
