"""A shard that changes after it was indexed is never read with the old index
(DATA_LOADER.VERIFY_SHARDS): a tiny server on 127.0.0.1 serves shard A while the shards are
indexed, then shard B of the same layout and size in its place.

- With a validator (ETag or Last-Modified), every read carries it and B answers 412, by ranges
  and read whole: refused naming the shard, even where B's headers are A's.
- Without validators, each image is read with its tar header: B's other member names are seen.
- An edit that keeps the size and every header on a server without validators is seen by
  default (each image's CRC-32, recorded at indexing, VERIFY_SHARDS members); only "headers"
  reads it as it is (its documented limit), and sha256 sees it too.
- A local shard rewritten with its size and modification time kept (cp -p) is indexed again at
  the next open (its change time moved), and caught mid-run by the header read.
- Under SKIP_CORRUPT the changed shard's samples are skipped and named, the others read; its
  index is dropped, so the next open indexes B and pairs B's images with B's labels."""

import hashlib
import io
import json
import os
import tarfile
import zlib

import pytest
import torch
from torchvision.io import encode_png

from pycls import config
from pycls.core import cli
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.formats.tar_index import IndexCache
from pycls.datasets.formats.tar_shards import TarShards
from pycls.datasets.loading import checks
from pycls.datasets.transport import remote_files
from tests.helpers import QUICKSTART, TINY
from tests.helpers.data_servers import (
    ETagHandler,
    LastModifiedHandler,
    NoRangeHandler,
    RangeHandler,
    Server,
)

MTIME = 1_700_000_000


def _png(value):
    """A 4x4 PNG stored without compression: its length is the same whatever its colour."""
    image = torch.full((3, 4, 4), value, dtype=torch.uint8)
    return encode_png(image, compression_level=0).numpy().tobytes()


def _tar_bytes(keys, values, labels):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, value, label in zip(keys, values, labels):
            for name, data in ((f"{key}.png", _png(value)), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), MTIME
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


KEYS_A, KEYS_B = ["000000", "000001", "000002", "000003"], ["000010", "000011", "000012", "000013"]
A = _tar_bytes(KEYS_A, [10, 20, 30, 40], [0, 1, 0, 1])
# Another shard of the same layout: other keys (same lengths), images and labels
B = _tar_bytes(KEYS_B, [50, 60, 70, 80], [1, 0, 1, 0])
# A's headers, one image's pixels edited: the same size, every header byte the same
EDITED = _tar_bytes(KEYS_A, [11, 20, 30, 40], [0, 1, 0, 1])
assert len(A) == len(B) == len(EDITED) and A != EDITED


def _replace(path, data, later=True):
    """Writes ``data`` in place of the file at ``path``, a minute later by its clock."""
    path.write_bytes(data)
    if later:
        os.utime(path, (MTIME + 60, MTIME + 60))


def _serve_a(tmp_path):
    folder = tmp_path / "served"
    folder.mkdir()
    path = folder / "train-000000.tar"
    path.write_bytes(A)
    os.utime(path, (MTIME, MTIME))
    return folder, path


def _values(got):
    """The colour of each image read (each is one colour), or the error's class."""
    return [g[0][0, 0, 0].item() if isinstance(g, tuple) else type(g).__name__ for g in got]


@pytest.mark.parametrize("window", [0, None], ids=["by-ranges", "read-whole"])
@pytest.mark.parametrize("handler", [ETagHandler, LastModifiedHandler])
def test_a_replaced_shard_answers_412_to_the_validator_it_was_indexed_with(
    tmp_path, handler, window
):
    """EDITED keeps every header of A: only the validator can tell, and does, by ranges and
    read whole (the whole shard's request carries it too)."""
    folder, path = _serve_a(tmp_path)
    with Server(folder, handler) as server:
        url = server.url("train-000000.tar")
        tars = TarShards([url], cache_dir=tmp_path / "ix", window=window)
        assert tars._reader.whole_files == (window is None)
        _replace(path, EDITED)
        got = tars.load_many([0, 1, 2, 3])
        with pytest.raises(CorruptImageError) as err:
            tars[2]
    assert all(isinstance(g, CorruptImageError) for g in got), _values(got)
    line = str(got[0])
    assert f"000000.png of shard {url}: its shard changed since it was indexed" in line
    assert "the server answered HTTP 412 Precondition Failed" in line and "\n" not in line
    assert url in str(err.value) and "changed since it was indexed" in str(err.value)


@pytest.mark.parametrize(
    "handler, window",
    [(RangeHandler, 0), (RangeHandler, None), (NoRangeHandler, 0)],
    ids=["by-ranges", "read-whole", "no-ranges-server"],
)
def test_without_validators_a_shard_with_other_headers_is_caught_by_the_header_read_again(
    tmp_path, handler, window
):
    """The server sends neither ETag nor Last-Modified: B's size is A's, so only the tar header
    read with each image tells (before: B's images trained with A's labels)."""
    folder, path = _serve_a(tmp_path)
    with Server(folder, handler) as server:
        url = server.url("train-000000.tar")
        tars = TarShards([url], cache_dir=tmp_path / "ix", window=window)
        _replace(path, B)
        got = tars.load_many([1, 0, 3])
    assert all(isinstance(g, CorruptImageError) for g in got), _values(got)
    line = str(got[0])
    assert f"000001.png of shard {url}: its shard changed since it was indexed" in line
    assert (
        "the tar header of member '000001.png' (byte 2,048) now names '000011.png' (120 bytes)"
        in line
    )


def test_a_same_size_same_header_edit_without_validators_is_refused_by_default(tmp_path):
    """No default trains an image with another one's label: EDITED keeps A's size and every
    header, on a server without validators; each image's CRC-32 (indexed, VERIFY_SHARDS members,
    the default) refuses it, by ranges and read whole. "headers" reads it as it is (its limit);
    sha256 refuses it. Before, the default read EDITED's pixels with A's labels."""
    folder, path = _serve_a(tmp_path)
    with Server(folder, RangeHandler) as server:
        url = server.url("train-000000.tar")
        members = TarShards([url], cache_dir=tmp_path / "ix")
        whole = TarShards([url], cache_dir=tmp_path / "ix", window=None)
        headers = TarShards([url], cache_dir=tmp_path / "ix", verify="headers")
        hashed = TarShards([url], cache_dir=tmp_path / "ix-sha", verify="sha256")
        assert hashed._reader.digests[url] == hashlib.sha256(A).hexdigest()
        _replace(path, EDITED)
        got = {name: tars.load_many([0, 1]) for name, tars in
               (("members", members), ("whole", whole), ("headers", headers),
                ("sha256", hashed))}  # fmt: skip
    assert _values(got["headers"]) == [11, 20]  # EDITED's pixels, not detected
    # The edited image is refused, and once found, every sample of its shard
    for name in ("members", "whole"):
        assert _values(got[name]) == ["ShardChangedError", 20], name
    assert _values(got["sha256"]) == ["ShardChangedError"] * 2
    assert _values(members.load_many([1, 2])) == ["ShardChangedError"] * 2
    line = str(got["members"][0])
    assert f"000000.png of shard {url}: its shard changed since it was indexed" in line
    assert "the bytes of member '000000.png' are not the ones indexed" in line
    assert "its SHA-256 is no longer" in str(got["sha256"][0]) and url in str(got["sha256"][0])


def test_a_changed_shard_is_skipped_the_others_read_and_the_next_open_indexes_it_again(
    tmp_path, caplog
):
    folder, path = _serve_a(tmp_path)
    (folder / "train-000001.tar").write_bytes(A)
    with Server(folder, RangeHandler) as server:
        urls = [server.url("train-000000.tar"), server.url("train-000001.tar")]
        tars = TarShards(urls, cache_dir=tmp_path / "ix")
        cached = IndexCache(tmp_path / "ix")._path(urls[0])
        assert cached.exists()
        _replace(path, B)
        got = tars.load_many([0, 4, 1, 5])
        again = tars.load_many([2, 6])  # known changed: not read again, still named
        assert _values(got) == ["ShardChangedError", 10, "ShardChangedError", 20]
        assert _values(again) == ["ShardChangedError", 30]
        assert not cached.exists()  # dropped: the next open indexes B
        fresh = TarShards(urls, cache_dir=tmp_path / "ix")
        read = fresh.load_many([0, 1, 2, 3])
    changed = [r.getMessage() for r in caplog.records if "changed since" in r.getMessage()]
    assert len(changed) == 1 and urls[0] in changed[0]
    assert _values(read) == [50, 60, 70, 80] and fresh.labels[:4].tolist() == [1, 0, 1, 0]


def test_a_local_shard_rewritten_behind_its_size_and_time_is_indexed_again_and_caught_mid_run(
    tmp_path,
):
    """B written over A with A's size and modification time (cp -p, rsync -t): the next open
    indexes it again (its change time moved; before, the stale index paired B's images with A's
    labels, caught only image by image), and a process that opened A before the rewrite is held
    to A's headers."""
    path = tmp_path / "train-000000.tar"
    path.write_bytes(A)
    os.utime(path, (MTIME, MTIME))
    batch = TarShards([str(path)], cache_dir=tmp_path / "ix")
    single = TarShards([str(path)], cache_dir=tmp_path / "ix")
    TarShards([str(path)], cache_dir=tmp_path / "ix-sha", verify="sha256")
    _replace(path, B, later=False)
    os.utime(path, (MTIME, MTIME))  # as cp -p or rsync -t would keep it
    assert "now names '000010.png'" in str(batch.load_many([0])[0])
    with pytest.raises(CorruptImageError, match="now names '000011.png'"):
        single[1]  # one sample at a time, as the batch
    for cache, verify in (("ix", "members"), ("ix-sha", "sha256")):
        fresh = TarShards([str(path)], cache_dir=tmp_path / cache, verify=verify)
        assert _values(fresh.load_many([0, 1])) == [50, 60], verify
        assert fresh.labels.tolist() == [1, 0, 1, 0]


def test_an_index_cached_with_64_bit_header_digests_is_made_again_not_misread(tmp_path):
    """An index of version 3 recorded a 64-bit digest of each header (16 hex digits); the
    header's CRC-32 took its place, so such a cached index is made again."""
    path = tmp_path / "train-000000.tar"
    path.write_bytes(A)
    TarShards([str(path)], cache_dir=tmp_path / "ix")
    cached = IndexCache(tmp_path / "ix")._path(str(path))
    record = json.loads(cached.read_text())
    crcs = [sample[5:] for sample in record["samples"]]
    for sample in record["samples"]:  # as the 64-bit version wrote them
        head = A[sample[2] - tarfile.BLOCKSIZE : sample[2]]
        assert sample[5] == f"{zlib.crc32(head):08x}"
        sample[5] = hashlib.blake2b(head, digest_size=8).hexdigest()
    cached.write_text(json.dumps({**record, "version": 3}))
    shards = TarShards([str(path)], cache_dir=tmp_path / "ix")
    assert _values(shards.load_many([0, 1, 2, 3])) == [10, 20, 30, 40]
    assert [sample[5:] for sample in json.loads(cached.read_text())["samples"]] == crcs


def test_sha256_needs_each_shard_at_a_url_to_fit_the_read_ahead_bound(tmp_path):
    folder, _ = _serve_a(tmp_path)
    with Server(folder, RangeHandler) as server, pytest.raises(config.ConfigError) as err:
        TarShards([server.url("train-000000.tar")], cache_dir=tmp_path / "ix", verify="sha256",
                  access=remote_files.Access(readahead_bytes=4096))  # fmt: skip
    line = str(err.value)
    assert line.startswith("DATA_LOADER.VERIFY_SHARDS: 'sha256' reads each shard at a URL whole")
    assert "DATA_LOADER.READAHEAD_MB" in line and "\n" not in line


def test_verify_shards_is_checked_at_load():
    with pytest.raises(config.ConfigError, match="DATA_LOADER.VERIFY_SHARDS"):
        config.load_cfg(QUICKSTART, ["DATA_LOADER.VERIFY_SHARDS", "md5"])
    with pytest.raises(config.ConfigError) as err:
        config.load_cfg(QUICKSTART, ["DATA_LOADER.BACKEND", "parquet",
                                     "DATA_LOADER.VERIFY_SHARDS", "sha256"])  # fmt: skip
    assert "'sha256' hashes WebDataset tar shards (BACKEND wds), not parquet" in str(err.value)


def test_parquet_at_a_url_replaced_after_it_was_opened_is_refused_naming_it(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def write(values, labels):
        table = pa.table({"image": pa.array([_png(v) for v in values], pa.binary()),
                          "label": pa.array(labels, pa.int64())})  # fmt: skip
        pq.write_table(table, tmp_path / "train-000000.parquet", compression="none",
                       use_dictionary=False, write_statistics=False)  # fmt: skip

    write([10, 20], [0, 1])
    from pycls.datasets.formats.parquet_shards import ParquetShards

    with Server(tmp_path, ETagHandler) as server:
        url = server.url("train-000000.parquet")
        shards = ParquetShards([url])
        size = (tmp_path / "train-000000.parquet").stat().st_size
        write([50, 60], [1, 0])
        assert (tmp_path / "train-000000.parquet").stat().st_size == size
        with pytest.raises(CorruptImageError) as err:
            shards[0]
    line = str(err.value)
    assert url in line and "changed since it was indexed" in line and "HTTP 412" in line


_TRAIN = [*TINY, "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1",
          "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
          "DATA_LOADER.NUM_WORKERS", "0"]  # fmt: skip


def test_cli_a_shard_changed_mid_run_stops_in_one_line_or_is_skipped_and_named(
    tmp_path, capsys, monkeypatch
):
    """The run of the report: the server changes shard 0 after the run indexed it."""
    folder, path = _serve_a(tmp_path)
    (folder / "train-000001.tar").write_bytes(A)
    (folder / "val-000000.tar").write_bytes(A)
    planned = TarShards._plan_reads

    def plan_then_replace(self, *args):
        planned(self, *args)
        if any(s.endswith("train-000000.tar") for s in self.shards):
            _replace(path, B)

    monkeypatch.setattr(TarShards, "_plan_reads", plan_then_replace)
    with Server(folder, RangeHandler) as server:
        opts = ["--mode", "train", "--cfg", QUICKSTART, *_TRAIN, "DATA.PATH", server.url()]
        for run in ("a", "b"):
            path.write_bytes(A)
            status = cli.main([*opts, "OUT_DIR", str(tmp_path / run), "DATA_LOADER.INDEX_CACHE",
                               str(tmp_path / f"ix-{run}"), *(["DATA_LOADER.SKIP_CORRUPT", "True"]
                                                             if run == "b" else [])])  # fmt: skip
            if run == "a":
                (line,) = capsys.readouterr().err.strip().splitlines()
                assert status == 2 and "changed since it was indexed" in line, line
                assert server.url("train-000000.tar") in line
    assert status == 0, capsys.readouterr().err
    listed = (tmp_path / "b" / checks.SKIPPED_FILES).read_text()
    assert "train-000000.tar: its shard changed since it was indexed" in listed
