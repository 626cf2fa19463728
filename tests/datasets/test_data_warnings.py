"""What used to pass without a word: a class folder with no training image (warned; refused when
the test split has images of it), timm's spelling of a data set (``wds/NAME``, ``hfds/NAME``:
refused naming pycls's), and images ``prepare --format wds|parquet`` left out (named in the log
and listed in the output folder, as the own shards' writer does)."""

import contextlib
import io

import numpy as np
import pytest
from PIL import Image

from pycls import config
from pycls.core import cli
from pycls.datasets.formats.shard_writing import bad_images_file
from pycls.datasets.formats.synthetic import Synthetic
from pycls.datasets.formats.tar_writer import write_webdataset
from tests.helpers import QUICKSTART, TINY, load_tool


def _folder(root, counts):
    """An image folder whose split/class holds counts[split][class] small JPEGs."""
    rng = np.random.default_rng(0)
    for split, classes in counts.items():
        for name, count in classes.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.jpg")
    return root


def _train(tmp_path, data, *keys):
    args = ["--mode", "train", "--cfg", QUICKSTART, *TINY, "DATA.PATH", str(data),
            "MODEL.NUM_CLASSES", "3", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
            "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1",
            "OUT_DIR", str(tmp_path / "out"), *keys]  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(args)
    return status, err.getvalue().strip().splitlines()


def test_a_class_without_training_images_is_named(tmp_path):
    data = _folder(tmp_path / "data", {"train": {"a": 4, "b": 4, "c": 0},
                                       "val": {"a": 2, "b": 2, "c": 0}})  # fmt: skip
    status, err = _train(tmp_path, data)
    assert status == 0, err
    log = (tmp_path / "out" / "stdout.log").read_text()
    assert "1 class(es) have no training image (TRAIN.SPLIT train vs TEST.SPLIT val): c" in log


def test_a_class_without_training_images_but_with_test_images_is_refused(tmp_path):
    data = _folder(tmp_path / "data", {"train": {"a": 4, "b": 4, "c": 0},
                                       "val": {"a": 2, "b": 2, "c": 3}})  # fmt: skip
    status, err = _train(tmp_path, data)
    assert status == 2 and len(err) == 1, err
    assert "classes without a training image have test images" in err[0] and "c (3)" in err[0]


TIMM_NAMES = [("wds/imagenet", "DATA_LOADER.BACKEND wds"), ("hfds/timm/mini", "BACKEND parquet")]


@pytest.mark.parametrize("name, reader", TIMM_NAMES)
def test_timms_spelling_of_a_data_set_is_refused_naming_pycls(tmp_path, name, reader):
    write_webdataset(Synthetic(4, 8, 2), tmp_path / "wds", split="train", shard_size=4)
    for path in (str(tmp_path / "wds"), ""):
        with pytest.raises(config.ConfigError) as err:
            config.load_cfg(QUICKSTART, ["DATA.PATH", path, "TRAIN.DATASET", name])
        line = str(err.value)
        assert line.startswith(f"TRAIN.DATASET: {name!r} is timm's spelling"), line
        assert reader in line and "imagefolder" in line


@pytest.mark.parametrize("fmt", ["wds", "parquet"])
def test_prepare_names_the_images_it_left_out_in_the_log_and_the_folder(tmp_path, fmt, capsys):
    data = _folder(tmp_path / "data", {"train": {"a": 3, "b": 3}})
    (data / "train" / "b" / "broken.jpg").write_bytes(b"not a jpeg at all")
    tool = load_tool("prepare_dataset")
    out = tmp_path / fmt
    status = tool.main(["--dataset", "imagefolder", "--data", str(data), "--out", str(out),
                        "--format", fmt, "--splits", "train", "--size", "8",
                        "--workers", "1"])  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    broken = str(data / "train" / "b" / "broken.jpg")
    assert f"bad image left out: {broken}: " in printed
    assert f"1 bad image(s), listed in {bad_images_file(out, 'train')}" in printed
    (line,) = bad_images_file(out, "train").read_text().splitlines()
    assert line.startswith(f"{broken}\tcannot decode image {broken}")
