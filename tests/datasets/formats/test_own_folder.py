"""Your own image folder: DATA.PATH alone trains any config on train/ + val/ (or test/)."""

import os
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from pycls.config import ConfigError, load_cfg
from pycls.datasets import ImageFolder
from tests.helpers import QUICKSTART, ROOT, RUN_NET, TINY, json_stats_of
from tests.helpers.warm import run as warm_run

CLASSES = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}
TRAIN_FORMATS = (".jpg", ".png", ".webp", ".bmp", ".tif", ".JPEG")
VAL_FORMATS = (".jpg", ".png", ".webp")


def _write(path, color, rng):
    pixels = np.clip(rng.normal(color, 25, (20, 20, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return pixels


def make_folder(root, test_split="val"):
    """Real files in six formats under train/, three under val/ (or test/), three classes."""
    rng = np.random.default_rng(0)
    for name, color in CLASSES.items():
        for split, formats, copies in (("train", TRAIN_FORMATS, 2), (test_split, VAL_FORMATS, 1)):
            os.makedirs(root / split / name)
            for i in range(copies):
                for ext in formats:
                    _write(root / split / name / f"{i}{ext}", color, rng)
    (root / "train" / "red" / "notes.txt").write_text("not an image")
    return root


def test_every_format_decodes_with_its_pixels(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "train" / "a").mkdir(parents=True)
    lossless = {
        ext: _write(tmp_path / "train" / "a" / f"x{ext}", (90, 120, 150), rng)
        for ext in (".png", ".bmp", ".tif", ".ppm")
    }
    Image.fromarray(lossless[".png"]).save(tmp_path / "train" / "a" / "y.webp", lossless=True)
    ds = ImageFolder(tmp_path, "train")
    assert len(ds) == 5
    for index, (path, _) in enumerate(ds.samples):  # lossless: exactly the pixels written
        expected = lossless.get(os.path.splitext(path)[1], lossless[".png"])
        assert np.array_equal(ds[index][0].permute(1, 2, 0).numpy(), expected), path


def test_data_path_alone_makes_the_config_train_on_the_folder(tmp_path):
    folder = make_folder(tmp_path / "mine", test_split="test")
    cfg = load_cfg(QUICKSTART, ["DATA.PATH", str(folder)])  # a digits config, TEST.SPLIT test
    assert (cfg.TRAIN.DATASET, cfg.TEST.DATASET, cfg.TEST.SPLIT) == ("imagefolder",) * 2 + ("test",)
    os.rename(folder / "test", folder / "val")
    assert load_cfg(QUICKSTART, ["DATA.PATH", str(folder)]).TEST.SPLIT == "val"
    imagenet = load_cfg(os.path.join(ROOT, "configs", "vit_ti16.yaml"), ["DATA.PATH", str(folder)])
    assert imagenet.TEST.SPLIT == "val" and imagenet.TRAIN.DATASET == "imagefolder"
    os.rename(folder / "val", folder / "holdout")
    with pytest.raises(
        ConfigError, match=r"^TEST.SPLIT: .* DATA.PATH holds \['holdout', 'train'\]"
    ):
        load_cfg(QUICKSTART, ["DATA.PATH", str(folder)])
    assert load_cfg(QUICKSTART, ["DATA.PATH", str(folder), "TEST.SPLIT", "holdout"])
    # A CIFAR folder (pickles, no train/) keeps the data set the config names
    cifar = load_cfg(
        None, ["TRAIN.DATASET", "cifar10", "TEST.DATASET", "cifar10", "DATA.PATH", str(tmp_path)]
    )
    assert cifar.TRAIN.DATASET == "cifar10"


@pytest.mark.slow
def test_quickstart_trains_on_a_folder_given_by_data_path_alone(tmp_path):
    folder = make_folder(tmp_path / "mine")
    out = tmp_path / "out"
    small = ["TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8", "OPTIM.MAX_EPOCH", "1"]
    cmd = [sys.executable, RUN_NET, "--mode", "train", "--cfg", QUICKSTART, *TINY, *small]
    cmd += ["DATA.PATH", str(folder), "OUT_DIR", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = warm_run(cmd, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (out / "stdout.log").read_text()
    assert f"data imagefolder train: 36 images, 3 classes in {folder / 'train'}" in log
    assert f"data imagefolder val: 9 images, 3 classes in {folder / 'val'}" in log
    assert "MODEL.NUM_CLASSES 10 exceeds the 3 classes of imagefolder (train)" in log
    (test,) = json_stats_of(out, "test_epoch")
    assert test["num_samples"] == 9
    with open(out / "config.yaml") as f:
        resolved = yaml.safe_load(f)
    assert resolved["TRAIN"]["DATASET"] == resolved["TEST"]["DATASET"] == "imagefolder"
