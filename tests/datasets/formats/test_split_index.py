"""What a folder of shards holds is what its index says (pycls/datasets/formats/split_index.py and
the own shards' index.json): preparing again into the same folder trains only the new set, for tar
shards, parquet files and pycls's own shards; a shard the index does not list is refused naming it
(or skipped under DATA_LOADER.UNLISTED_SHARDS skip); a writer refuses to write beside another
writer's files of the split; a preparation killed part-way never trains a mix silently."""

import logging
import shutil

import pytest
import torch
from torch.utils.data import Dataset

from pycls import config
from pycls.checkpoint.files import CorruptFileError
from pycls.core import builders
from pycls.datasets.formats import parquet_writer, split_index, tar_writer
from pycls.datasets.formats.parquet_writer import write_parquet
from pycls.datasets.formats.prepared_shard_writer import prepare_split
from pycls.datasets.formats.prepared_shards import ShardDataset, verify_split
from pycls.datasets.formats.tar_writer import write_webdataset
from tests.helpers import tiny_quickstart


class _Squares(Dataset):
    """``n`` 8 px images of two classes, each image its own shade."""

    classes, num_classes = ["a", "b"], 2

    def __init__(self, n):
        self.labels = [k % 2 for k in range(n)]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, k):
        return torch.full((3, 8, 8), k * 9 % 256, dtype=torch.uint8), self.labels[k]


_WRITERS = {"wds": write_webdataset, "parquet": write_parquet}
# A file of the train split that a writer of the format would name, but not this preparation
_UNLISTED = {"wds": "train-000009.tar", "parquet": "data/train-00009-of-00010.parquet"}


def _write(fmt, out, split, n, shard_size):
    return _WRITERS[fmt](_Squares(n), out, split=split, shard_size=shard_size, encoding="png")


def _prepared(fmt, out):
    """12 training images in 3 files, 4 test images in one."""
    _write(fmt, out, "train", 12, 4)
    _write(fmt, out, "test", 4, 4)
    return out


def _lengths(out, *overrides):
    """(training, test) images a run on DATA.PATH ``out`` reads."""
    cfg = tiny_quickstart(out.parent / "run", "DATA.PATH", str(out), *overrides)
    return tuple(len(builders.build_dataset(cfg, train)) for train in (True, False))


@pytest.mark.parametrize("fmt", ["wds", "parquet"])
def test_preparing_again_into_the_same_folder_trains_only_the_new_set(tmp_path, fmt):
    """Broke when a second preparation left the first one's files of the split beside the new
    ones and training read them all (the old code: 12 + 8 stale tar images, every parquet image
    twice): the earlier files the new set does not hold are removed once it is recorded."""
    out = _prepared(fmt, tmp_path / fmt)
    result = _write(fmt, out, "train", 12, 12)
    files = sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob(f"*{'.tar' if fmt == 'wds' else '.parquet'}")
    )
    assert [f for f in files if "train" in f] == result.files
    assert _lengths(out) == (12, 4)


@pytest.mark.parametrize("fmt", ["wds", "parquet"])
def test_a_shard_the_index_does_not_list_is_refused_or_skipped(tmp_path, fmt, caplog):
    """Broke when a file of the split that _info.json does not list was trained with the listed
    ones (the old code read 24 images): refused naming the file and the key, or under
    UNLISTED_SHARDS skip left out and named once in the log."""
    out = _prepared(fmt, tmp_path / fmt)
    listed = sorted(out.rglob("train-00000*"))[0]
    shutil.copy(listed, out / _UNLISTED[fmt])
    with pytest.raises(config.ConfigError, match=r"train-0+9.*not listed.*UNLISTED_SHARDS skip"):
        _lengths(out)
    with caplog.at_level(logging.WARNING):
        assert _lengths(out, "DATA_LOADER.UNLISTED_SHARDS", "skip") == (12, 4)
    assert [r for r in caplog.records if "not listed" in r.getMessage()]


@pytest.mark.parametrize("fmt", ["wds", "parquet"])
def test_a_writer_refuses_another_writers_files_of_the_split(tmp_path, fmt):
    """Broke when a preparation wrote its files beside a file of the split that it did not name
    (another tool's shard), which the reader then trained with them: refused before writing."""
    out = tmp_path / fmt
    foreign = out / ("imagenet-train-0001.tar" if fmt == "wds" else "train.parquet")
    out.mkdir()
    foreign.write_bytes(b"not ours")
    with pytest.raises(ValueError, match="imagenet-train-0001.tar|train.parquet"):
        _write(fmt, out, "train", 12, 4)
    assert not list(out.rglob("*-0000*"))  # nothing written
    _write(fmt, out, "test", 4, 4)  # another split's files are no concern of it


def test_a_preparation_killed_part_way_never_trains_a_mix(tmp_path, monkeypatch):
    """Broke when a second preparation killed after writing some of its files left them beside
    the first one's under the first one's record, and training read the mix: killed before its
    record or after it (before removing the earlier files), what the record does not list is
    refused, and under UNLISTED_SHARDS skip only the set the record lists is read, whole; the
    rerun finishes and removes the earlier files."""
    out = _prepared("parquet", tmp_path / "pq")
    real = parquet_writer._parquet_file

    def killed_after_first(job, source):
        if job[0] == 1:
            raise KeyboardInterrupt  # as a kill: nothing after this point runs
        return real(job, source)

    monkeypatch.setattr(parquet_writer, "_parquet_file", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        _write("parquet", out, "train", 12, 6)
    with pytest.raises(config.ConfigError, match="train-00000-of-00002.parquet.*not listed"):
        _lengths(out)
    assert _lengths(out, "DATA_LOADER.UNLISTED_SHARDS", "skip") == (12, 4)  # the first set whole
    monkeypatch.setattr(parquet_writer, "_parquet_file", real)
    monkeypatch.setattr(split_index, "remove_stale", lambda earlier, names: None)
    _write("parquet", out, "train", 12, 6)  # recorded, killed before the earlier files go
    assert len(list(out.rglob("train-*.parquet"))) == 5
    with pytest.raises(config.ConfigError, match="train-00000-of-00003.parquet.*not listed"):
        _lengths(out)
    assert _lengths(out, "DATA_LOADER.UNLISTED_SHARDS", "skip") == (12, 4)  # the new set
    monkeypatch.undo()
    _write("parquet", out, "train", 12, 6)
    assert len(list(out.rglob("train-*.parquet"))) == 2


def test_a_tar_preparation_killed_before_its_record_is_refused_not_mixed(tmp_path, monkeypatch):
    """The tar writer writes over the files of the earlier set (the same names, here the same
    sample counts at another image size): the split's list is emptied first, so a kill part-way
    leaves files the index does not list (refused), never the earlier record over a mix of 16 px
    and 8 px images (broke when the record was left as it was: the counts agreed, it trained)."""
    out = _prepared("wds", tmp_path / "wds")
    real = tar_writer._tar_file

    def killed_after_first(job, source):
        if job[0] == 1:
            raise KeyboardInterrupt
        return real(job, source)

    monkeypatch.setattr(tar_writer, "_tar_file", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        write_webdataset(_Squares(12), out, split="train", shard_size=4, size=16, encoding="png")
    with pytest.raises(config.ConfigError, match="train-000000.tar.*not listed"):
        _lengths(out)


def test_own_shards_the_index_does_not_name_are_refused_by_reader_and_writer(tmp_path):
    """pycls's own shards (BACKEND shards): a shard_NNNNN.bin that index.json does not name is
    refused by the reader naming it (broke: it was silently ignored), left out with a warning
    under skip, reported by --verify, and refused by a preparation into the folder."""
    folder = tmp_path / "train"
    prepare_split(_Squares(6), folder, dataset="squares", split="train", shard_size=3)
    shutil.copy(folder / "shard_00000.bin", folder / "shard_00007.bin")
    with pytest.raises(CorruptFileError, match="shard_00007.bin is not named in"):
        ShardDataset(tmp_path, "train")
    with pytest.warns(UserWarning, match="shard_00007.bin"):
        assert len(ShardDataset(tmp_path, "train", unlisted="skip")) == 6
    assert any("shard_00007.bin" in p for p in verify_split(folder))
    with pytest.raises(ValueError, match="shard_00007.bin is not a shard of this preparation"):
        prepare_split(_Squares(6), folder, dataset="squares", split="train", shard_size=3)
