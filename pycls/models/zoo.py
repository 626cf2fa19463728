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

import os
import shutil
import urllib.request

import torch
from torch import nn

from pycls.atomic_files import atomic_file
from pycls.errors import UserError
from pycls.models.cnn.anynet import AnyNet
from pycls.models.cnn.effnet import EffNet
from pycls.models.cnn.regnet import RegNet
from pycls.models.cnn.upstream_weights import best_weights, is_upstream_checkpoint
from pycls.models.cnn.zoo_table import PREFIXES, ZOO, ZooModel
from pycls.models.vit.args import VIT_SPECS
from pycls.models.vit.variants import build_vit

URL_PREFIX = "https://dl.fbaipublicfiles.com/pycls/dds_baselines"
ENV_CACHE_DIR = "PYCLS_ZOO_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "pycls", "zoo")
FAMILIES = {"regnet": RegNet, "anynet": AnyNet, "effnet": EffNet}


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
    with atomic_file(path, "wb") as out, urllib.request.urlopen(url, timeout=30) as response:
        shutil.copyfileobj(response, out)


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
