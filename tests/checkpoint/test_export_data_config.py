"""A timm export carries how pycls evaluated the model (mean, std, input size, interpolation, crop
percentage and mode) in its timm_kwargs' pretrained_cfg_overlay: plain timm, following
docs/finetuning.md and then ``timm.data.resolve_data_config`` / ``create_transform``, evaluates
it as pycls does, logits equal to pycls's own to float32 rounding."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from pycls.core import builders, exports, trainer
from pycls.datasets import DeviceBatches
from pycls.datasets.loading.transforms import eval_data_config
from tests.helpers import tiny_quickstart

timm = pytest.importorskip("timm")


def _plain_timm(path):
    """The exported model as plain timm builds it (docs/finetuning.md), and its data config."""
    from timm.data import resolve_data_config

    meta = safe_open(path, "pt").metadata()
    model = timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"]))
    model.load_state_dict(load_file(path))
    return model.eval(), resolve_data_config(model=model)


def test_plain_timm_evaluates_an_export_as_pycls_does(tmp_path):
    from timm.data import create_transform

    out = tmp_path / "run"
    cfg = tiny_quickstart(out, "OPTIM.MAX_EPOCH", "1")
    trainer.train_model(cfg)
    path = exports.export_checkpoint(str(out / "model_final.safetensors"), "timm")
    model, config = _plain_timm(path)
    mean, std = builders.normalisation(cfg, train=False)
    # JSON has no tuples: timm takes the lists as they come
    got = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    assert got == {"input_size": (3, 16, 16), "interpolation": "bilinear", "mean": tuple(mean),
                   "std": tuple(std), "crop_pct": 1.0, "crop_mode": "squash"}  # fmt: skip
    # 32 test digits as pycls evaluates them: its preset to 16 px, normalised on the device
    dataset = builders.build_dataset(cfg, train=False)
    samples = [dataset[(i, 0, 16)] for i in range(32)]
    images = torch.stack([image for image, _ in samples])
    loader = [(images, torch.zeros(32, dtype=torch.int64), 0)]
    ours_model, _ = exports.model_from_checkpoint(str(out / "model_final.safetensors"))
    (batch, _, _), = DeviceBatches(_Loader(loader), "cpu", mean, std)  # fmt: skip
    with torch.no_grad():
        ours = ours_model.eval()(batch)
        pil = [Image.fromarray(np.ascontiguousarray(x.permute(1, 2, 0).numpy())) for x in images]
        theirs = model(torch.stack([create_transform(**config)(p) for p in pil]))
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


class _Loader(list):
    """A list of batches with the one attribute DeviceBatches' CPU path reads."""

    num_workers = 0

    def __iter__(self):
        return iter(list.__iter__(self))


@pytest.mark.parametrize(
    "preset, mode, crop", [("imagenet", "center", 0.875), ("cifar", "squash", 1.0)]
)
def test_each_presets_evaluation_in_timms_terms(preset, mode, crop):
    config = eval_data_config(preset, 224)
    assert config == {"input_size": (3, 224, 224), "interpolation": "bilinear",
                      "crop_pct": crop, "crop_mode": mode}  # fmt: skip
