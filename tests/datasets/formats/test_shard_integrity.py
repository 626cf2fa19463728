"""What was indexed is what is read: a WebDataset tar shard cut short, two tars written one after
the other, a shard whose sample count differs from its ``_info.json``, and a sample with a member
written twice are refused naming the shard (and the sample), or read in part under
DATA_LOADER.SKIP_CORRUPT with the shard named (pycls.datasets.formats.tar_shards)."""

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from torchvision.io import encode_png

from pycls.checkpoint.files import CorruptFileError
from pycls.core import cli
from pycls.datasets.formats.tar_index import INDEX_VERSION, IndexCache, index_shard
from pycls.datasets.formats.tar_shards import TarShards
from pycls.datasets.loading import checks
from tests.helpers import QUICKSTART, TINY


def _png(value):
    return encode_png(torch.full((3, 4, 4), value, dtype=torch.uint8)).numpy().tobytes()


def _tar_bytes(first, count):
    """A tar of samples ``first`` ... ``first + count - 1`` (a png and a cls each, label n % 2),
    as tarfile writes it (two zero blocks, padded to its record size)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for n in range(first, first + count):
            for name, data in ((f"s{n:04d}.png", _png(n)), (f"s{n:04d}.cls", str(n % 2).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _header_offset(data, name):
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getmember(name).offset


def _split(folder, lengths, recorded=None):
    """Shards train-00000K.tar of ``lengths`` samples and the _info.json recording
    ``recorded`` (default: the lengths) for them."""
    folder.mkdir(parents=True, exist_ok=True)
    files, first = [], 0
    for k, n in enumerate(lengths):
        path = folder / f"train-{k:06d}.tar"
        path.write_bytes(_tar_bytes(first, n))
        files.append(str(path))
        first += n
    recorded = recorded or lengths
    info = {"splits": {"train": {"name": "train", "num_samples": sum(recorded),
                                 "filenames": [Path(f).name for f in files],
                                 "shard_lengths": list(recorded)}},
            "num_classes": 2}  # fmt: skip
    (folder / "_info.json").write_text(json.dumps(info))
    return files, info


def _cut_between_samples(path, keep):
    """``path`` cut at the header of sample ``keep`` (a 512-byte boundary: tarfile stops there
    without a word)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: _header_offset(data, f"s{keep:04d}.png")])


def test_a_shard_cut_between_samples_is_refused_naming_it_and_what_is_missing(tmp_path):
    files, info = _split(tmp_path / "wds", [10, 5])
    _cut_between_samples(files[0], 6)
    with pytest.raises(CorruptFileError, match="without tar's end-of-archive blocks") as err:
        index_shard(files[0])
    assert files[0] in str(err.value)
    with pytest.raises(CorruptFileError) as err:
        TarShards(files, cache_dir=tmp_path / "ix", info=info)
    line = str(err.value)
    assert line.startswith(f"shard {files[0]} is truncated") and "\n" not in line
    # The last sample before the cut may lack members that lay past it: it is not counted whole
    assert "holds 5 whole samples, _info.json records 10 (5 missing)" in line
    assert "DATA_LOADER.SKIP_CORRUPT True" in line
    # Without _info.json the cut is still seen (the end-of-archive blocks are missing)
    with pytest.raises(CorruptFileError, match="is truncated"):
        TarShards(files, cache_dir=tmp_path / "ix")


def test_under_skip_corrupt_a_cut_shard_gives_its_whole_samples_and_is_named(tmp_path):
    files, info = _split(tmp_path / "wds", [10, 5])
    _cut_between_samples(files[0], 6)
    shards = TarShards(files, cache_dir=tmp_path / "ix", info=info, skip_corrupt=True)
    assert len(shards) == 10 and shards.shard_sizes == [5, 5]
    (line,) = shards.damaged
    assert line.startswith(f"shard {files[0]} is truncated") and "(5 missing)" in line
    # named with the corrupt samples a run skips (skipped_files.txt)
    checks.set_skipped_files(str(tmp_path))
    try:
        checks.record_damaged(shards.damaged)
    finally:
        checks.set_skipped_files(None)
    assert (tmp_path / checks.SKIPPED_FILES).read_text().splitlines() == [line]


def test_two_tars_written_one_after_the_other_are_refused(tmp_path):
    path = tmp_path / "train-000000.tar"
    path.write_bytes(_tar_bytes(0, 4) + _tar_bytes(4, 3))
    with pytest.raises(CorruptFileError, match="after its end-of-archive blocks") as err:
        index_shard(str(path))
    assert str(path) in str(err.value) and "two tars" in str(err.value)
    shards = TarShards([str(path)], cache_dir=tmp_path / "ix", skip_corrupt=True)
    assert len(shards) == 4 and "holds 4 whole samples" in shards.damaged[0]


def test_data_tarfile_cannot_read_after_the_last_member_is_refused(tmp_path):
    path = tmp_path / "train-000000.tar"
    data = _tar_bytes(0, 3)
    end = _header_offset(data, "s0002.cls") + 1024  # its header and its data block
    path.write_bytes(data[:end] + b"garbage!" * 64 + data[end + 512 :])
    with pytest.raises(CorruptFileError, match="header tar cannot read"):
        index_shard(str(path))


def test_a_whole_shard_that_differs_from_its_info_json_is_refused(tmp_path):
    files, info = _split(tmp_path / "wds", [4, 3], recorded=[4, 6])
    with pytest.raises(CorruptFileError) as err:
        TarShards(files, cache_dir=tmp_path / "ix", info=info)
    assert str(err.value).startswith(
        f"shard {files[1]} differs from _info.json; it holds 3 whole samples, _info.json "
        "records 6 (3 missing)"
    )
    shards = TarShards(files, cache_dir=tmp_path / "ix", info=info, skip_corrupt=True)
    assert len(shards) == 7 and len(shards.damaged) == 1


def test_a_member_written_twice_is_refused_naming_the_sample(tmp_path):
    """WebDataset refuses a duplicate file name; the last one used to win without a word."""
    path = tmp_path / "train-000000.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("a.png", _png(0)), ("a.cls", b"0"), ("a.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CorruptFileError, match="sample 'a' has two 'cls' members") as err:
        TarShards([str(path)], cache_dir=tmp_path / "ix", skip_corrupt=True)
    assert str(path) in str(err.value)


def test_an_index_made_before_the_end_was_checked_is_made_again(tmp_path):
    files, info = _split(tmp_path / "wds", [6])
    _cut_between_samples(files[0], 3)
    cache = IndexCache(tmp_path / "ix")
    from pycls.datasets.transport import remote_files

    old = {"version": INDEX_VERSION - 1, "url": files[0],
           "identity": remote_files.file_identity(files[0]),
           "samples": [[f"s{n:04d}", f"s{n:04d}.png", 512, 10, 0] for n in range(3)]}  # fmt: skip
    cache._write(cache._path(files[0]), old)
    with pytest.raises(CorruptFileError, match="is truncated"):
        TarShards(files, cache_dir=tmp_path / "ix", info=info)


def test_a_cut_shard_at_a_url_is_seen_in_the_bytes_the_index_reads(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    data = _tar_bytes(0, 5)
    fs = fsspec.filesystem("memory")
    fs.pipe("/pycls-integrity/train-000000.tar", data[: _header_offset(data, "s0003.png")])
    with pytest.raises(CorruptFileError, match="is truncated"):
        TarShards(["memory://pycls-integrity/train-000000.tar"], cache_dir=tmp_path / "ix")


_TRAIN = [*TINY, "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1",
          "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]  # fmt: skip


def test_cli_a_cut_shard_stops_in_one_line_or_is_named_under_skip_corrupt(tmp_path, capsys):
    files, _ = _split(tmp_path / "wds", [10, 5])
    _cut_between_samples(files[0], 6)
    opts = ["--mode", "train", "--cfg", QUICKSTART, *_TRAIN, "DATA.PATH", str(tmp_path / "wds"),
            "DATA.TEST_PATH", files[1], "DATA_LOADER.INDEX_CACHE", str(tmp_path / "i")]  # fmt: skip
    status = cli.main([*opts, "OUT_DIR", str(tmp_path / "a")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and line.startswith(f"error: shard {files[0]} is truncated"), line
    assert "(5 missing)" in line
    status = cli.main([*opts, "OUT_DIR", str(tmp_path / "b"), "DATA_LOADER.SKIP_CORRUPT", "True"])
    assert status == 0, capsys.readouterr().err
    listed = (tmp_path / "b" / checks.SKIPPED_FILES).read_text().splitlines()
    assert listed[0].startswith(f"shard {files[0]} is truncated") and "(5 missing)" in listed[0]
    log = (tmp_path / "b" / "stdout.log").read_text()
    assert "data imagefolder train: 10 images" in log
