"""Image folders that are wrong: a test split with other classes, corrupt images skipped and
named (file names of any bytes escaped on one line), listed once across a resume, and
decompression bombs refused before decoding from the size the header declares (every format the
decoders read), in training and in ``tools/prepare_dataset.py``."""

import io
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from pycls import config
from pycls.checkpoint import single_file as checkpoint
from pycls.core import logging as logs
from pycls.core import trainer
from pycls.datasets import CorruptImageError, ImageFolder
from pycls.datasets.formats.image_header import declared_size
from pycls.datasets.formats.imagefolder import decode_rgb
from pycls.datasets.formats.prepared_shard_writer import prepare_split
from pycls.datasets.formats.prepared_shards import (
    BAD_IMAGES,
)
from pycls.datasets.loading import checks
from pycls.errors import UserError
from tests.helpers import (
    ROOT,
    json_stats_of,
    scaled,
    tiny_quickstart,
)
from tests.helpers.warm import run as warm_run

pytestmark = pytest.mark.usefixtures("single_thread")


def _image_folder(root, classes, per_class=2):
    from torchvision.io import write_png

    for cls in classes:
        split, name = cls.split("/")
        (root / split / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = torch.full((3, 16, 16), 40 * i + 10 * len(name), dtype=torch.uint8)
            write_png(image, str(root / split / name / f"{i}.png"))


_FOLDER = ["TRAIN.DATASET", "imagefolder", "TEST.DATASET", "imagefolder", "TEST.SPLIT", "val"]


_SMALL = ["TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1"]


def test_test_split_with_other_classes_is_an_error_listing_them(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "train/c1", "train/c2", "val/c0", "val/c2", "val/c3"])
    cfg = tiny_quickstart(tmp_path / "run", *_FOLDER, *_SMALL, "DATA.PATH", str(data))
    with pytest.raises(checks.ClassMismatchError) as e:
        trainer.Trainer(cfg, trainer.setup_env(cfg))
    assert "missing from the test split: c1" in str(e.value)
    assert "not in the training split: c3" in str(e.value)


def test_class_list_is_stored_and_skipped_files_are_named(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "train/c1", "val/c0", "val/c1"], per_class=4)
    bad = data / "train" / "c1" / "9.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "run"
    skip = [
        "DATA_LOADER.SKIP_CORRUPT",
        "True",
        "DATA.PATH",
        str(data),
        "DATA_LOADER.NUM_WORKERS",
        "1",
    ]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    state = checkpoint.load_file(checkpoint.get_checkpoint_path(str(out), 1))
    assert state["classes"] == ["c0", "c1"]
    listed = (out / checks.SKIPPED_FILES).read_text().splitlines()
    assert len(listed) == 1 and str(bad) in listed[0]
    log = (out / logs.LOG_FILE).read_text()
    assert f"skipped a corrupt sample: cannot decode image {bad}" in log
    # Evaluating with a test split of other classes than the checkpoint's is refused too
    shutil.rmtree(data / "val" / "c1")
    test = ["TEST.WEIGHTS", checkpoint.get_checkpoint_path(str(out), 1), *skip]
    with pytest.raises(checks.ClassMismatchError, match="missing from the test split: c1"):
        trainer.test_model(tiny_quickstart(tmp_path / "test", *_FOLDER, *_SMALL, *test))


def _bad_files(folder, names):
    for name in names:  # bytes: a file name need not be UTF-8
        with open(os.path.join(os.fsencode(folder), name), "wb") as f:
            f.write(b"not a png")


_ODD_NAMES = [b"bad\xff.png", b"two\nlines.png"]


def test_file_names_of_any_bytes_are_escaped_in_logs_lists_and_errors(tmp_path):
    """A corrupt image named with bytes that are not UTF-8, another with a newline, in an OUT_DIR
    that is not UTF-8 either: the run skips both, names each on one escaped line in the log and
    in skipped_files.txt, and json_stats keep the exact bytes of the checkpoint's path."""
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "val/c0", "val/c1"], per_class=4)
    _image_folder(data, ["train/c1"], per_class=2)
    _bad_files(data / "train" / "c1", _ODD_NAMES)
    out = os.fsdecode(os.fsencode(tmp_path) + b"/run\xfe")
    skip = ["DATA_LOADER.SKIP_CORRUPT", "True", "DATA.PATH", str(data)]
    skip += ["DATA_LOADER.NUM_WORKERS", "1"]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    where = f"{data}/train/c1/"
    listed = (Path(out) / checks.SKIPPED_FILES).read_bytes().decode("utf-8").splitlines()
    assert sorted(line.split(":")[0] for line in listed) == [
        f"cannot decode image {where}bad\\xff.png",
        f"cannot decode image {where}two\\nlines.png",
    ]
    log = (Path(out) / logs.LOG_FILE).read_bytes().decode("utf-8")
    for name in ("bad\\xff.png", "two\\nlines.png"):
        assert f"skipped a corrupt sample: cannot decode image {where}{name}: " in log
    assert "run\\xfe/checkpoints/model_epoch_0001.pyth" in log
    # A resume's json_stats line carries the checkpoint's path with its exact bytes
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip, "OPTIM.MAX_EPOCH", "2"))
    (resumed,) = json_stats_of(out, "resume")
    assert os.fsencode(resumed["checkpoint"]).startswith(os.fsencode(out) + b"/checkpoints/")
    # Without SKIP_CORRUPT the error is one line naming the file
    bad = os.fsdecode(os.path.join(os.fsencode(data / "train" / "c1"), _ODD_NAMES[1]))
    with pytest.raises(CorruptImageError) as e:
        decode_rgb(bad)
    assert str(e.value).startswith(f"cannot decode image {where}two\\nlines.png: ")
    assert "\n" not in str(e.value)
    assert UserError(f"cannot read {out}").one_line().endswith("run\\xfe")


def test_prepared_shards_list_odd_file_names_escaped(tmp_path):
    """tools/prepare_dataset.py's bad_images.txt: one escaped line per unreadable file."""
    data = tmp_path / "data"
    _image_folder(data, ["train/c0"], per_class=2)
    _bad_files(data / "train" / "c0", _ODD_NAMES)
    folder = tmp_path / "shards" / "train"
    result = prepare_split(ImageFolder(data, "train"), folder, dataset="imagefolder",
                           split="train", size=8)  # fmt: skip
    assert result.num_samples == 2
    lines = (folder / BAD_IMAGES).read_bytes().decode("utf-8").splitlines()
    names = sorted(line.split("\t")[0].rsplit("/", 1)[1] for line in lines)
    assert names == ["bad\\xff.png", "two\\nlines.png"]


def test_skipped_files_lists_a_file_once_across_a_resume(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "val/c0", "val/c1"], per_class=4)
    _image_folder(data, ["train/c1"], per_class=3)
    _bad_files(data / "train" / "c1", [b"bad.png"])
    out = tmp_path / "run"
    skip = ["DATA_LOADER.SKIP_CORRUPT", "True", "DATA.PATH", str(data)]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip, "OPTIM.MAX_EPOCH", "2"))
    assert len(json_stats_of(out, "resume")) == 1
    assert sum(s["num_skipped"] for s in json_stats_of(out, "train_epoch")) == 2  # each epoch
    (line,) = (out / checks.SKIPPED_FILES).read_text().splitlines()
    assert line.startswith(f"cannot decode image {data}/train/c1/bad.png: ")


def _pil_bytes(size, fmt, **options):
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(buffer, fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "fmt, options",
    [("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("GIF", {}),
     ("WEBP", {}), ("WEBP", {"lossless": True}), ("WEBP", {"exif": b"Exif\0\0MM"}),
     ("BMP", {}), ("TIFF", {}), ("PPM", {})],
)  # fmt: skip
def test_image_headers_declare_the_size_the_decoder_gives(fmt, options):
    from pycls.datasets.formats import decode

    data = _pil_bytes((37, 23), fmt, **options)
    assert declared_size(data) == (37, 23)
    decoded = decode.decode_rgb(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert tuple(decoded.shape[-2:]) == (23, 37)


def test_a_bomb_in_a_format_pil_sizes_is_refused_too(tmp_path):
    from PIL import Image

    bomb = tmp_path / "bomb.tif"  # 400 million pixels in 330 KB: more than PIL itself opens
    Image.new("1", (20_000, 20_000)).save(bomb, "TIFF", compression="tiff_lzw")
    with pytest.raises(CorruptImageError, match="declares more than 178,956,970 pixels"):
        decode_rgb(str(bomb))


def _png_bomb(path, side=10_000):
    """A real PNG of side x side pixels (100 million: 300 MB as RGB) in a few kilobytes."""
    from PIL import Image

    Image.new("1", (side, side)).save(path, "PNG")


def test_decompression_bomb_is_refused_before_decoding_naming_file_and_size(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0", "train/c1", "val/c0", "val/c1"], per_class=4)
    bomb = data / "train" / "c1" / "bomb.png"
    _png_bomb(bomb)
    assert bomb.stat().st_size < 100_000
    why = "it declares 10000 x 10000 = 100,000,000 pixels, more than the limit of 89,478,485"
    with pytest.raises(CorruptImageError, match=f"^refusing image {bomb}: {why} "):
        decode_rgb(str(bomb))
    out = tmp_path / "run"
    skip = ["DATA_LOADER.SKIP_CORRUPT", "True", "DATA.PATH", str(data)]
    trainer.train_model(tiny_quickstart(out, *_FOLDER, *_SMALL, *skip))
    listed = (out / checks.SKIPPED_FILES).read_text().splitlines()
    assert len(listed) == 1 and listed[0].startswith(f"refusing image {bomb}: {why}")
    # The limit is a key; a lower one refuses the small images too
    with pytest.raises(config.ConfigError, match="DATA_LOADER.MAX_IMAGE_PIXELS: must be >= 0"):
        tiny_quickstart(out, "DATA_LOADER.MAX_IMAGE_PIXELS", "-1")
    small = tiny_quickstart(tmp_path / "r2", *_FOLDER, *_SMALL, "DATA.PATH", str(data),
                            "DATA_LOADER.MAX_IMAGE_PIXELS", "255")  # fmt: skip
    with pytest.raises(CorruptImageError, match="declares 16 x 16 = 256 pixels"):
        trainer.train_model(small)


def test_prepare_dataset_lists_a_bomb_as_bad(tmp_path):
    data = tmp_path / "data"
    _image_folder(data, ["train/c0"], per_class=2)
    _png_bomb(data / "train" / "c0" / "bomb.png")
    tool = os.path.join(ROOT, "tools", "prepare_dataset.py")
    out = tmp_path / "shards"
    cmd = [sys.executable, tool, "--dataset", "imagefolder", "--data", str(data), "--out",
           str(out), "--splits", "train", "--size", "8", "--workers", "1"]  # fmt: skip
    done = warm_run(cmd, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    (line,) = (out / "train" / BAD_IMAGES).read_text().splitlines()
    assert line.startswith(f"{data}/train/c0/bomb.png\trefusing image ")
    assert "declares 10000 x 10000" in line
