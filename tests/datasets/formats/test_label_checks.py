"""Labels are checked where they enter (pycls.datasets.formats.labels): whole numbers only (an
integral float is taken, 2.9999 is refused, never cut to 2), no nulls, within the class count (the
one the data declares, else MODEL.NUM_CLASSES), strings only as declared class names; in tar shards,
parquet files and prepared shards alike, each refusal one line naming the file and sample."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from torchvision.io import encode_png

from pycls.checkpoint.files import CorruptFileError, file_record
from pycls.core import cli
from pycls.datasets.formats.digits import Digits
from pycls.datasets.formats.parquet_shards import ParquetShards
from pycls.datasets.formats.parquet_writer import hf_metadata
from pycls.datasets.formats.prepared_shard_writer import prepare_split
from pycls.datasets.formats.prepared_shards import ShardDataset, _fields_crc32
from pycls.datasets.formats.tar_shards import TarShards
from tests.helpers import QUICKSTART, TINY

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _png(value=0):
    return encode_png(torch.full((3, 4, 4), value, dtype=torch.uint8)).numpy().tobytes()


def _tar(path, labels, ext="cls"):
    """A tar shard of one png per label, each with the label as ``ext`` (cls: the text; json:
    {"label": value})."""
    with tarfile.open(path, "w") as tar:
        for n, label in enumerate(labels):
            data = str(label).encode() if ext == "cls" else json.dumps({"label": label}).encode()
            for name, body in ((f"s{n}.png", _png(n)), (f"s{n}.{ext}", data)):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return str(path)


def _one_line_naming(err, *parts):
    text = str(err.value)
    assert "\n" not in text and all(p in text for p in parts), text


@pytest.mark.parametrize(
    "labels, ext, info, why",
    [
        ([0, 10**30], "cls", {}, "sample 's1' has the label 1.000e+30"),
        ([0, 12], "cls", {"num_classes": 10}, "class indices are 0 to 9: 10 classes"),
        ([0, -1], "cls", {}, "sample 's1' has the label -1"),
        ([0, 2.5], "json", {}, "2.5 is not a whole number"),
        ([True], "json", {}, "true is not a class index"),
        ([None], "json", {}, "null is not a class index"),
        (["0", "2.9999"], "cls", {}, "2.9999 is not a whole number"),
        (["cat"], "cls", {}, "'cat', a class name, but the data declares no class names"),
        (["cat"], "json", {"classes": ["dog", "bird"]}, "not one of the 2 declared class names"),
    ],
)
def test_a_tar_label_that_is_no_class_index_is_refused_naming_the_sample(
    tmp_path, labels, ext, info, why
):
    path = _tar(tmp_path / "train-000000.tar", labels, ext)
    with pytest.raises(CorruptFileError) as err:
        TarShards([path], cache_dir=tmp_path / "ix", info=info)
    _one_line_naming(err, f"shard {path}", why)


def test_tar_labels_that_are_class_indices_are_taken(tmp_path):
    ints = _tar(tmp_path / "a.tar", [3.0, 1, "cat"], "json")
    shards = TarShards([ints], cache_dir=tmp_path / "ix", info={"classes": list("abcd") + ["cat"]})
    assert shards.labels.tolist() == [3, 1, 4] and shards.num_classes == 5
    text = _tar(tmp_path / "b.tar", [" 2\n", "3.0"])
    assert TarShards([text], cache_dir=tmp_path / "ix").labels.tolist() == [2, 3]


def test_without_declared_classes_labels_are_bounded_by_the_model(tmp_path):
    path = _tar(tmp_path / "a.tar", [0, 10])
    with pytest.raises(CorruptFileError) as err:
        TarShards([path], cache_dir=tmp_path / "ix", num_classes=10)
    _one_line_naming(err, "sample 's1' has the label 10", "10 classes (MODEL.NUM_CLASSES)")


_TRAIN = [*TINY, "TRAIN.BATCH_SIZE", "2", "TEST.BATCH_SIZE", "2", "OPTIM.MAX_EPOCH", "1",
          "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]  # fmt: skip


@pytest.mark.parametrize("case", ["tar 10^30", "parquet null", "parquet strings", "parquet ints"])
def test_cli_a_label_out_of_range_is_one_line_exit_2(tmp_path, capsys, case):
    """A tar label of 10^30 was an overflow traceback; a parquet null a traceback mid-run; string
    labels without class names, and image cells that are numbers, tracebacks at the first batch."""
    bad = str(tmp_path / "train-00000-of-00001.parquet")
    if case == "tar 10^30":
        bad = _tar(tmp_path / "train-000000.tar", [0, 10**30, 1, 0])
        named = f"shard {bad}: sample 's1' has the label 1.000e+30"
    elif case == "parquet null":
        _parquet(bad, [0, None, 1, 0])
        named = f"row 1 of {bad} has no label (null)"
    elif case == "parquet strings":
        _parquet(bad, ["cat", "dog", "cat", "dog"])
        named = f"row 0 of {bad} has the label 'cat': the label column holds strings, but the file"
    else:
        _parquet(bad, [0, 1, 0, 1], images=pa.array([7, 8, 9, 10]))
        named = f"{bad}: its image column 'image' holds int64 values, not encoded images"
    status = cli.main(["--mode", "train", "--cfg", QUICKSTART, *_TRAIN, "DATA.PATH", bad,
                       "DATA.TEST_PATH", bad, "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix"),
                       "OUT_DIR", str(tmp_path / "out")])  # fmt: skip
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and line.startswith(f"error: {named}"), line


# ---- parquet --------------------------------------------------------------------------------- #


def _parquet(path, labels, label_type=None, names=None, images=None):
    images = images if images is not None else pa.array([_png(n) for n in range(len(labels))])
    table = pa.table({"image": images, "label": pa.array(labels, type=label_type)})
    if names is not None:
        table = table.replace_schema_metadata(hf_metadata(names))
    pq.write_table(table, path)
    return str(path)


@pytest.mark.parametrize(
    "labels, label_type, names, why",
    [
        ([2.9999, 0.5, 9.99], pa.float64(), None, "row 0 of {} has the label 2.9999, not a whole"),
        ([1.0, float("nan")], pa.float32(), None, "row 1 of {} has the label nan"),
        ([0, None, 1], pa.int64(), None, "row 1 of {} has no label (null)"),
        (["cat", "dog"], pa.string(), None, "the file declares no class names"),
        (["cat", "cow"], pa.string(), ["cat", "dog"], "row 1 of {} has the label 'cow'"),
        ([0, 5], pa.int64(), ["cat", "dog"], "row 1 of {} has the label 5; class indices are 0 to"),
        ([True, False], pa.bool_(), None, "the label column holds bool values"),
    ],
)
def test_a_parquet_label_column_is_validated_not_cast(tmp_path, labels, label_type, names, why):
    path = _parquet(tmp_path / "a.parquet", labels, label_type, names)
    with pytest.raises(CorruptFileError) as err:
        ParquetShards([path])
    _one_line_naming(err, why.format(path))


def test_parquet_labels_that_are_class_indices_are_taken(tmp_path):
    floats = _parquet(tmp_path / "a.parquet", [3.0, 0.0, 1.0], pa.float64())
    assert ParquetShards([floats]).labels.tolist() == [3, 0, 1]
    named = _parquet(tmp_path / "b.parquet", ["dog", "cat"], pa.string(), ["cat", "dog"])
    shards = ParquetShards([named])
    assert shards.labels.tolist() == [1, 0] and shards.classes == ["cat", "dog"]
    coded = _parquet(tmp_path / "c.parquet", pa.array(["dog", "cat"]).dictionary_encode(),
                     None, ["cat", "dog"])  # fmt: skip
    assert ParquetShards([coded]).labels.tolist() == [1, 0]


def test_parquet_image_cells_that_are_numbers_are_refused_at_open(tmp_path):
    path = _parquet(tmp_path / "a.parquet", [0, 1], images=pa.array([7, 8]))
    with pytest.raises(CorruptFileError) as err:
        ParquetShards([path])
    _one_line_naming(err, path, "image column 'image' holds int64 values, not encoded images")


# ---- prepared shards --------------------------------------------------------------------------- #


def test_a_prepared_index_whose_label_exceeds_its_classes_is_refused_at_open(tmp_path):
    folder = tmp_path / "shards" / "train"
    prepare_split(torch.utils.data.Subset(Digits("train"), range(6)), folder, dataset="digits",
                  split="train", shard_size=6)  # fmt: skip
    # An index rewritten with its checksums (a crafted split, or another program's)
    with np.load(folder / "index.npz") as index:
        arrays = dict(index)
    arrays["labels"][4] = 12
    np.savez(folder / "index.npz", **arrays)
    info = json.loads((folder / "index.json").read_text())
    info["index_checksum"] = file_record(folder / "index.npz")
    info["fields_crc32"] = _fields_crc32(info)
    (folder / "index.json").write_text(json.dumps(info))
    with pytest.raises(CorruptFileError) as err:
        ShardDataset(tmp_path / "shards", "train")
    n = info["num_classes"]
    _one_line_naming(err, "index.npz: sample 4 has the label 12", f"0 to {n - 1}: {n} classes")
