"""Parquet files whose Image column holds a path and no bytes, as Hugging Face ``datasets`` writes
local image files (the files here are written by ``datasets`` itself): read from a local file
(paths below its folder, relative or absolute; any path with DATA_LOADER.IMAGE_PATHS any) and
from a URL (relative paths under the same folder of the same server), the same pixels
``datasets.load_dataset`` gives; every other path refused in one line naming the row, never
read."""

import contextlib
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from pycls.core import cli
from pycls.datasets import CorruptImageError
from pycls.datasets.formats.parquet_shards import ParquetShards
from tests.helpers import QUICKSTART, TINY, json_stats_of
from tests.helpers.data_servers import Server

datasets = pytest.importorskip("datasets")


def _png(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.full((6, 5, 3), value, dtype=np.uint8)
    pixels[0, :, 0] = 255 - value  # not a flat image: rows and channels must come out in place
    Image.fromarray(pixels).save(path)
    return path


def _write(path, images, labels, names=("a", "b")):
    """A parquet file written by ``datasets`` from image paths (strings, kept as given; the
    batch size given, so that datasets does not size files a path may not name)."""
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(names))}
    )
    table = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(str(path), batch_size=100)
    return path


def _pixels(path):
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


@pytest.fixture(autouse=True)
def _quiet_bars():
    datasets.disable_progress_bars()


def test_absolute_paths_as_datasets_writes_them_read_like_load_dataset(tmp_path):
    files = [_png(tmp_path / "photos" / f"{i}.png", 40 * i) for i in range(4)]
    parquet = _write(tmp_path / "pq" / "train.parquet", [str(f) for f in files], [0, 1, 1, 0])
    raw = datasets.Dataset.from_parquet(str(parquet))
    assert raw.data.column("image")[0].as_py() == {"bytes": None, "path": str(files[0])}
    reference = datasets.load_dataset("parquet", data_files=str(parquet), split="train")
    shards = ParquetShards([str(parquet)], image_paths="any")  # photos/ is beside pq/
    assert shards.classes == ["a", "b"] and shards.labels.tolist() == [0, 1, 1, 0]
    for i in range(4):
        expected = torch.from_numpy(np.array(reference[i]["image"].convert("RGB")))
        image, label = shards[i]
        assert torch.equal(image, expected.permute(2, 0, 1)) and label == reference[i]["label"]
    loaded = shards.load_many([3, 1])
    assert torch.equal(loaded[0][0], _pixels(files[3])) and loaded[1][1] == 1


def test_a_run_trains_on_parquet_that_names_its_images(tmp_path):
    """The user's case: train/ and validation parquet written by datasets from local files kept
    beside the parquet folder, which the user allows (DATA_LOADER.IMAGE_PATHS any)."""
    for split, count in (("train", 8), ("validation", 4)):
        files = [_png(tmp_path / "images" / split / f"{i}.png", 25 * i) for i in range(count)]
        _write(tmp_path / "pq" / f"{split}-00000-of-00001.parquet", [str(f) for f in files],
               [i % 2 for i in range(count)])  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["--mode", "train", "--cfg", QUICKSTART, *TINY, "DATA.PATH",
                           str(tmp_path / "pq"), "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8",
                           "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4",
                           "OPTIM.MAX_EPOCH", "1", "DATA_LOADER.IMAGE_PATHS", "any",
                           "OUT_DIR", str(tmp_path / "out")])  # fmt: skip
    assert status == 0, err.getvalue()
    (epoch,) = json_stats_of(tmp_path / "out", "train_epoch")
    assert epoch["num_samples"] == 8 and epoch["num_skipped"] == 0


def test_relative_paths_are_read_against_the_parquet_files_folder(tmp_path):
    files = [_png(tmp_path / "set" / "images" / f"{i}.png", 60 * i) for i in range(3)]
    parquet = _write(tmp_path / "set" / "train.parquet", [f"images/{i}.png" for i in range(3)],
                     [0, 1, 0])  # fmt: skip
    shards = ParquetShards([str(parquet)])
    assert all(torch.equal(shards[i][0], _pixels(files[i])) for i in range(3))


def test_a_row_whose_file_is_missing_is_refused_saying_it_holds_a_path(tmp_path):
    good = _png(tmp_path / "a.png", 9)
    parquet = _write(tmp_path / "t.parquet", [str(good), str(tmp_path / "gone.png")], [0, 1])
    shards = ParquetShards([str(parquet)])
    assert torch.equal(shards[0][0], _pixels(good))
    with pytest.raises(CorruptImageError) as err:
        shards[1]
    line = str(err.value)
    assert f"row 1 of {parquet}" in line and "holds a path and no bytes" in line
    assert str(tmp_path / "gone.png") in line and "\n" not in line


def test_a_parquet_file_at_a_url_names_only_files_below_its_folder(tmp_path):
    root = tmp_path / "served"
    files = [_png(root / "set" / "images" / f"{i}.png", 30 * i) for i in range(2)]
    _png(root / "secret.png", 200)  # beside the data set's folder: never to be read
    hostile = ["/etc/hostname", str(files[0]), "../secret.png", "images/../../secret.png",
               "http://127.0.0.2/images/0.png", "file:///etc/hostname"]  # fmt: skip
    _write(root / "set" / "train.parquet", ["images/0.png", "images/1.png", *hostile],
           [0, 1] + [0] * len(hostile))  # fmt: skip
    with Server(root) as server:
        shards = ParquetShards([server.url("set/train.parquet")])
        assert torch.equal(shards[0][0], _pixels(files[0]))
        assert torch.equal(shards[1][0], _pixels(files[1]))
        for row, path in enumerate(hostile, start=2):
            with pytest.raises(CorruptImageError) as err:
                shards[row]
            line = str(err.value)
            assert f"row {row} of {server.url('set/train.parquet')}" in line, line
            assert "holds a path and no bytes" in line and path in line
            assert "only files below its own folder" in line
        asked = {path for path, _ in server.requests}
    assert "/secret.png" not in asked and not any(p.startswith("/etc") for p in asked)


def test_a_local_parquet_file_names_only_files_below_its_folder_unless_allowed(tmp_path):
    """The URL rule on disk by default (before: any file the user could read, /etc/passwd
    included, was read into memory and refused only at decoding): an absolute path elsewhere, a
    '..' that climbs out and a link that leads out are refused naming the key, never opened; an
    absolute path and a link that stay below the folder are read; with IMAGE_PATHS any, all are."""
    outside = _png(tmp_path / "outside.png", 200)
    inside = _png(tmp_path / "set" / "images" / "0.png", 30)
    (tmp_path / "set" / "images" / "out.png").symlink_to(outside)
    (tmp_path / "set" / "images" / "in.png").symlink_to(inside)
    paths = ["images/0.png", str(inside), "images/in.png",  # below its folder
             str(outside), "../outside.png", "images/out.png", "/etc/hostname"]  # fmt: skip
    parquet = _write(tmp_path / "set" / "train.parquet", paths, [0] * len(paths))
    shards = ParquetShards([str(parquet)])
    for row in range(3):
        assert torch.equal(shards[row][0], _pixels(inside)), row
    opened = []
    real_open = os.open
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
        for row, path in enumerate(paths[3:], start=3):
            with pytest.raises(CorruptImageError) as err:
                shards[row]
            line = str(err.value)
            assert f"row {row} of {parquet}" in line and path in line and "\n" not in line
            assert "only files below its own folder" in line
            assert "DATA_LOADER.IMAGE_PATHS any" in line
    assert not any("outside" in p or p.startswith("/etc") for p in opened), opened
    anywhere = ParquetShards([str(parquet)], image_paths="any")
    assert all(torch.equal(anywhere[row][0], _pixels(outside)) for row in (3, 4, 5))


def test_a_url_path_that_climbs_out_percent_encoded_is_refused(tmp_path):
    """'%2e%2e/' is '..' to the server (Python's http.server decodes before it resolves): the
    path is compared decoded, so it no longer passes as a name below the folder."""
    root = tmp_path / "served"
    good = _png(root / "set" / "images" / "0.png", 30)
    _png(root / "secret.png", 200)
    hostile = [
        "%2e%2e/secret.png",
        "images/%2e%2e/%2e%2e/secret.png",
        "images/..%2f..%2fsecret.png",
    ]
    _write(root / "set" / "train.parquet", ["images/0.png", *hostile], [0] * 4)
    with Server(root) as server:
        shards = ParquetShards([server.url("set/train.parquet")])
        assert torch.equal(shards[0][0], _pixels(good))
        for row in range(1, 4):
            with pytest.raises(CorruptImageError, match="only files below its own folder"):
                shards[row]
        asked = {path for path, _ in server.requests}
    assert not any("secret" in p for p in asked), asked
