"""WebDataset tar shards and Hugging Face parquet files: written by pycls and read back by the
libraries alone (webdataset, datasets, timm); read by pycls from local paths, fsspec's memory
file system and a local HTTP server (one that drops connections mid-shard too); the epoch orders
and their split across 2 gloo processes x 2 loader workers, stopped mid-epoch and resumed on
other numbers of processes; corrupt members, malformed shards and the config keys.
Everything is generated in tmp_path; the HTTP servers listen on 127.0.0.1 only."""

import functools
import http.server
import io
import json
import os
import socket
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pycls import config
from pycls.checkpoint import resume
from pycls.checkpoint.files import CorruptFileError
from pycls.core import builders, cli, resume_point, trainer
from pycls.datasets import (
    AugmentedDataset,
    Cifar,
    CorruptImageError,
    Digits,
    ImageFolder,
    build_transform,
    construct_loader,
)
from pycls.datasets.formats import data_sources
from pycls.datasets.formats.parquet_shards import ParquetShards
from pycls.datasets.formats.parquet_writer import write_parquet
from pycls.datasets.formats.tar_index import index_shard
from pycls.datasets.formats.tar_shards import TarShards, read_info
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.datasets.loading import checks, epoch_orders
from pycls.datasets.loading.corrupt_samples import Skipped
from pycls.datasets.loading.loader import SeededSampler
from pycls.datasets.transport import remote_files
from tests.helpers import (
    QUICKSTART,
    TINY,
    StopRequested,
    free_port,
    json_stats_of,
    load_tool,
    tiny_quickstart,
)
from tests.helpers.cifar import make_cifar

# ------------------------------------------------------------------------------------------------ #
# Data made here
# ------------------------------------------------------------------------------------------------ #


def _image_folder(root, classes=("a", "b", "c"), per_class=4, splits=("train", "val")):
    rng = np.random.default_rng(0)
    for split in splits:
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (12 + i, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.jpg", quality=95)
    return root


def _png(value, size=4):
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (value, 255 - value, 7)).save(buf, format="PNG")
    return buf.getvalue()


def _tar(path, members):
    """A tar file of (name, bytes) members, in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _numbered_shards(folder, sizes):
    """Tar shards whose sample n (counted across shards) has label n: the label names it."""
    folder.mkdir(parents=True, exist_ok=True)
    n, files = 0, []
    for k, size in enumerate(sizes):
        members = []
        for _ in range(size):
            members += [(f"s{n:04d}.png", _png(n % 256)), (f"s{n:04d}.cls", str(n).encode())]
            n += 1
        files.append(str(_tar(folder / f"train-{k:06d}.tar", members)))
    return files


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """An image folder written as tars (original bytes) and as parquet (original bytes)."""
    root = tmp_path_factory.mktemp("formats")
    data = _image_folder(root / "images")
    for split in ("train", "val"):
        source = ImageFolder(data, split)
        write_webdataset(source, root / "wds", split=split, shard_size=5, encoding="original")
        write_parquet(source, root / "parquet", split=split, shard_size=5, encoding="original")
    return root


# ------------------------------------------------------------------------------------------------ #
# A local HTTP server with byte ranges, and one that drops connections
# ------------------------------------------------------------------------------------------------ #


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _serve(self, head):
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            return super().do_HEAD() if head else super().do_GET()  # the listing fsspec parses
        if not os.path.isfile(path):
            return self.send_error(404)
        size = os.path.getsize(path)
        start, end = 0, size - 1
        ranged = self.headers.get("Range", "").startswith("bytes=")
        if ranged:
            first, last = self.headers["Range"][6:].split("-")
            start, end = int(first or 0), min(int(last) if last else size - 1, size - 1)
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        if self.server.drop(self.path, len(body)):
            self.wfile.write(body[: len(body) // 2])  # half the answer, then the line goes dead
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root, drops=0, drop_suffix=".tar", min_bytes=0):
        super().__init__(("127.0.0.1", 0), functools.partial(_RangeHandler, directory=str(root)))
        self.drops, self.dropped, self.suffix, self.min_bytes = drops, [], drop_suffix, min_bytes
        self.lock = threading.Lock()

    def drop(self, path, size):
        with self.lock:
            if self.drops and path.endswith(self.suffix) and size > self.min_bytes:
                self.drops -= 1
                self.dropped.append(path)
                return True
        return False

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()

    def url(self, path=""):
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"


# ------------------------------------------------------------------------------------------------ #
# Writing, and reading with the libraries alone
# ------------------------------------------------------------------------------------------------ #


def test_written_shards_read_back_by_pycls_exactly(written, tmp_path):
    """Both conventions give the image folder's pixels, labels, classes and shard lengths."""
    folder = ImageFolder(written / "images", "train")
    files = data_sources.split_files(str(written / "wds"), "train", "wds")
    info = read_info(data_sources.info_file(files, str(written / "wds")))
    tars = TarShards(files, cache_dir=tmp_path / "index", info=info)
    parquet = ParquetShards(data_sources.split_files(str(written / "parquet"), "train", "parquet"))
    for shards in (tars, parquet):
        assert len(shards) == len(folder) == 12 and shards.shard_sizes == [5, 5, 2]
        assert shards.classes == ["a", "b", "c"] and shards.num_classes == 3
        for i in range(len(folder)):
            image, label = folder[i]
            got, got_label = shards[i]
            assert got_label == label and torch.equal(got, image), i
        loaded = shards.load_many([7, 0, 11, 7])
        assert [lab for _, lab in loaded] == [folder.labels[i] for i in (7, 0, 11, 7)]
        assert torch.equal(loaded[1][0], folder[0][0])


def test_webdataset_alone_reads_the_written_tars(written):
    import webdataset as wds

    urls = [str(p) for p in sorted((written / "wds").glob("train-*.tar"))]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    folder = ImageFolder(written / "images", "train")
    assert len(samples) == len(folder)
    for sample, (path, label) in zip(samples, folder.samples):
        assert sample["jpg"] == Path(path).read_bytes()  # the original bytes
        assert int(sample["cls"]) == label and json.loads(sample["json"])["label"] == label
    info = json.loads((written / "wds" / "_info.json").read_text())
    assert info["splits"]["train"]["shard_lengths"] == [5, 5, 2]
    assert info["splits"]["val"]["num_samples"] == 12


def test_hugging_face_datasets_alone_reads_the_written_parquet(written, tmp_path):
    import datasets

    loaded = datasets.load_dataset(str(written / "parquet"), cache_dir=str(tmp_path / "hf"))
    assert sorted(loaded) == ["train", "val"]
    train = loaded["train"]
    assert train.features["label"].names == ["a", "b", "c"]
    assert type(train.features["image"]).__name__ == "Image"
    folder = ImageFolder(written / "images", "train")
    assert [row["label"] for row in train] == list(folder.labels)
    first = np.array(train[0]["image"].convert("RGB"))
    assert torch.equal(torch.from_numpy(first).permute(2, 0, 1), folder[0][0])


def test_timm_alone_reads_both(written, tmp_path):
    timm_data = pytest.importorskip("timm.data")
    wds_set = timm_data.create_dataset(
        "wds/written", root=str(written / "wds"), split="train", is_training=False, batch_size=1
    )
    labels = [label for _, label in wds_set]
    assert labels == list(ImageFolder(written / "images", "train").labels)
    hf_set = timm_data.create_dataset(
        f"hfds/{written / 'parquet'}", root=str(tmp_path / "hf"), split="val"
    )
    assert len(hf_set) == 12 and hf_set[0][0].size == (16, 12)


def test_cifar_written_as_png_keeps_every_pixel(tmp_path):
    make_cifar(tmp_path / "cifar", 10)
    source = Cifar(tmp_path / "cifar", "test", num_classes=10)
    write_webdataset(source, tmp_path / "wds", split="test", shard_size=2, encoding="png")
    write_parquet(source, tmp_path / "pq", split="test", shard_size=2, encoding="png")
    tars = TarShards(sorted(str(p) for p in (tmp_path / "wds").glob("*.tar")),
                     cache_dir=tmp_path / "index")  # fmt: skip
    parquet = ParquetShards(sorted(str(p) for p in (tmp_path / "pq" / "data").glob("*.parquet")))
    for shards in (tars, parquet):
        assert shards.num_classes >= max(source.labels.tolist()) + 1
        for i in range(len(source)):
            assert torch.equal(shards[i][0], source[i][0]) and shards[i][1] == source[i][1]


def test_jpeg_resized_writing_and_bad_images_listed(tmp_path):
    data = _image_folder(tmp_path / "images", splits=("train",))
    (data / "train" / "a" / "bad.jpg").write_bytes(b"not a jpeg")
    result = write_webdataset(ImageFolder(data, "train"), tmp_path / "wds", split="train",
                              size=8, encoding="jpeg", shard_size=100)  # fmt: skip
    assert result.num_samples == 12 and len(result.bad) == 1 and "bad.jpg" in result.bad[0][0]
    shards = TarShards([str(tmp_path / "wds" / result.files[0])], cache_dir=tmp_path / "ix")
    assert shards[0][0].shape == (3, 8, 8)
    with pytest.raises(ValueError, match="original"):
        write_parquet(ImageFolder(data, "train"), tmp_path / "p", split="train", size=8,
                      encoding="original")  # fmt: skip


# ------------------------------------------------------------------------------------------------ #
# Epoch orders and the split across ranks
# ------------------------------------------------------------------------------------------------ #


def test_shard_order_is_seeded_complete_and_bounded():
    sizes = [7, 7, 7, 5]
    a = epoch_orders.shard_order(sizes, 123, buffer=4)
    assert a == epoch_orders.shard_order(sizes, 123, buffer=4)
    assert a != epoch_orders.shard_order(sizes, 124, buffer=4)
    assert sorted(a) == list(range(26))
    # Without a buffer each shard is read whole, in order, the shards permuted
    plain = epoch_orders.shard_order(sizes, 123, buffer=0)
    starts = [0, 7, 14, 21]
    pos, shards = 0, []
    while pos < 26:
        k = next(k for k, s in enumerate(starts) if s == plain[pos])
        assert plain[pos : pos + sizes[k]] == list(range(starts[k], starts[k] + sizes[k]))
        shards.append(k)
        pos += sizes[k]
    assert sorted(shards) == [0, 1, 2, 3]
    # A sample leaves at most `buffer` places before its place in the unbuffered stream
    stream = np.arange(1000)
    shuffled = epoch_orders.buffer_shuffle(stream, 16, np.random.default_rng(0))
    place = np.empty(1000, dtype=int)
    place[shuffled] = np.arange(1000)
    assert (stream - place <= 16).all() and sorted(shuffled.tolist()) == list(range(1000))
    # Resampled: whole shards drawn with replacement, the epoch as long as the data
    drawn = epoch_orders.shard_order(sizes, 5, buffer=0, resampled=True)
    assert len(drawn) == 26 and len(set(drawn)) < 26


@pytest.mark.parametrize("order", ["global", "shards", "resampled"])
def test_any_stop_resumes_on_other_process_counts_with_exactly_the_rest(order):
    """Stopped after k steps on W processes (batch b each), the steps of W' processes with the
    same global batch skipping what the checkpoint's position says load exactly the rest of the
    epoch; every rank has as many batches, though the last shard is shorter."""
    sizes = [7, 7, 7, 5]
    kwargs = dict(shuffle=True, seed=3, image_size=4, drop_last=True, order=order,
                  shard_sizes=sizes, shuffle_buffer=5)  # fmt: skip
    for world, batch, steps, new_world in [(2, 3, 2, 1), (2, 3, 3, 3), (3, 2, 1, 2), (1, 6, 1, 2)]:
        streams = []
        for rank in range(world):
            s = SeededSampler(26, rank=rank, world_size=world, grain=_grain(order, batch), **kwargs)
            s.set_epoch(1)
            keys = [(i, seed) for i, seed, _ in s]
            streams.append(keys[: len(keys) - len(keys) % batch])  # the loader's whole batches
        assert len({len(keys) for keys in streams}) == 1
        whole = sorted(k for keys in streams for k in keys)
        done = [k for keys in streams for k in keys[: steps * batch]]
        new_batch = world * batch // new_world
        rest = []
        for rank in range(new_world):
            s = SeededSampler(26, rank=rank, world_size=new_world,
                              grain=_grain(order, new_batch), **kwargs)  # fmt: skip
            s.set_epoch(1, skip=steps * new_batch)
            keys = [(i, seed) for i, seed, _ in s]
            rest += keys[: len(keys) - (len(keys) + s.skip) % new_batch]
        assert sorted(done + rest) == whole, (world, batch, steps, new_world)


def _grain(order, batch):
    return batch if order != "global" else 1


def _epoch_keys(loader, epoch, stop=None):
    loader.sampler.set_epoch(epoch)
    seen = []
    for step, (_, labels, _) in enumerate(loader):
        if stop is not None and step == stop:
            break
        seen.append(labels.tolist())
    return seen


def _two_ranks(rank, port, shards, out, orders):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    factory = functools.partial(build_transform, "none")
    dataset = AugmentedDataset(TarShards(shards, cache_dir=Path(out).parent / "ix"), factory, True)
    seen = {}
    for order in orders:
        loader = construct_loader(
            dataset, batch_size=3, shuffle=True, drop_last=True, num_workers=2, pin_memory=False,
            persistent_workers=False, prefetch_factor=2, seed=0, image_size=4, rank=rank,
            world_size=2, order=order, shuffle_buffer=5,
        )  # fmt: skip
        seen[order] = {
            "len": len(loader),
            "epoch0": _epoch_keys(loader, 0),
            "epoch1": _epoch_keys(loader, 1),
            "stopped": _epoch_keys(loader, 1, stop=2),
            "settings": loader.sampler.order_settings(),
        }
    gathered = [None, None]
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def test_two_gloo_processes_two_workers_each_sample_once_and_resume_exact(tmp_path):
    """2 processes x 2 loader workers over 4 tar shards of 7, 7, 7 and 5 samples (each label
    names its sample): an epoch loads each of its samples once, the ranks as many batches; a
    stop after 2 steps of the next epoch resumed on 1 process or on 3 (the checkpoint's position
    through pycls.checkpoint.resume) loads exactly the samples not yet seen."""
    shards = _numbered_shards(tmp_path / "shards", [7, 7, 7, 5])
    out = tmp_path / "seen.json"
    orders = ["global", "shards", "resampled"]
    torch.multiprocessing.start_processes(
        _two_ranks, args=(free_port(), shards, str(out), orders), nprocs=2, start_method="fork"
    )
    ranks = json.loads(out.read_text())
    dataset = TarShards(shards, cache_dir=tmp_path / "ix")
    factory = functools.partial(build_transform, "none")
    augmented = AugmentedDataset(dataset, factory, True)
    for order in orders:
        r0, r1 = ranks[0][order], ranks[1][order]
        assert r0["len"] == r1["len"] == 4  # 26 samples, 2 x 3 per step: 4 steps, 2 dropped
        for epoch in ("epoch0", "epoch1"):
            assert len(r0[epoch]) == len(r1[epoch]) == 4
            flat = [k for r in (r0, r1) for batch in r[epoch] for k in batch]
            if order != "resampled":
                assert len(flat) == len(set(flat)) == 24, (order, epoch)
        whole = sorted(k for r in (r0, r1) for batch in r["epoch1"] for k in batch)
        before = [k for r in (r0, r1) for batch in r["stopped"] for k in batch]
        assert len(before) == 12
        saved = {"epoch": 1, "iter": 2, "position": resume.epoch_position(
            12, 6, 1, 2, 26, 0, 1, r0["settings"])}  # fmt: skip
        for world in (1, 3):
            batch = 6 // world
            after = []
            for rank in range(world):
                loader = construct_loader(
                    augmented, batch_size=batch, shuffle=True, drop_last=True,
                    num_workers=2 if world == 1 else 0, pin_memory=False,
                    persistent_workers=False, prefetch_factor=2, seed=0, image_size=4,
                    rank=rank, world_size=world, order=order, shuffle_buffer=5,
                )  # fmt: skip
                now = resume.epoch_position(0, 6, 1, world, 26, 0, 1,
                                            loader.sampler.order_settings())  # fmt: skip
                done = resume_point.steps_done("ckpt", saved, now)
                assert done == 2
                loader.sampler.set_epoch(1, skip=done * batch)
                after += [k for _, labels, _ in loader for k in labels.tolist()]
            assert sorted(before + after) == whole, (order, world)


def test_a_changed_order_is_refused_mid_epoch_and_older_checkpoints_are_global():
    sampler = SeededSampler(26, shuffle=True, seed=0, image_size=4, order="shards",
                            shard_sizes=[7, 7, 7, 5], shuffle_buffer=5)  # fmt: skip
    saved = {"epoch": 0, "iter": 1, "position": resume.epoch_position(
        6, 6, 1, 1, 26, 0, 1, sampler.order_settings())}  # fmt: skip
    sampler.shuffle_buffer = 6
    now = resume.epoch_position(0, 6, 1, 1, 26, 0, 1, sampler.order_settings())
    with pytest.raises(resume.ChangedEpochError, match="^DATA_LOADER.ORDER"):
        resume_point.steps_done("ckpt", saved, now)
    older = {"epoch": 0, "iter": 1, "position": dict(saved["position"])}
    del older["position"]["order"]
    assert resume_point.steps_done("ckpt", older, resume.epoch_position(0, 6, 1, 1, 26, 0, 1)) == 1


# ------------------------------------------------------------------------------------------------ #
# URLs: fsspec's memory file system and a local HTTP server
# ------------------------------------------------------------------------------------------------ #


def test_memory_filesystem_urls(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    local = _numbered_shards(tmp_path / "shards", [3, 2])
    fs = fsspec.filesystem("memory")
    for path in local:
        fs.pipe(f"/pycls-test/{Path(path).name}", Path(path).read_bytes())
    urls = data_sources.expand_pattern("memory://pycls-test/train-{000000..000001}.tar")
    shards = TarShards(urls, cache_dir=tmp_path / "ix")
    assert shards.labels.tolist() == [0, 1, 2, 3, 4] and shards[4][1] == 4
    assert data_sources.detect_format("memory://pycls-test/train-{000000..000001}.tar") == "wds"


def test_http_stream_reads_the_same_samples_with_dropped_connections_retried(written, tmp_path):
    """Over a local HTTP server: the split's files found by listing the folder, the same pixels
    and labels as from disk; a server that cuts answers mid-shard (while indexing, and while
    reading samples) is read again, each drop retried, nothing left out."""
    local_tars = TarShards(data_sources.split_files(str(written / "wds"), "train", "wds"),
                           cache_dir=tmp_path / "ix0")  # fmt: skip
    local_pq = ParquetShards(data_sources.split_files(str(written / "parquet"), "train", "parquet"))
    with _Server(written, drops=3, min_bytes=100) as server:
        files = data_sources.split_files(server.url("wds/"), "train", "wds")
        assert [Path(f).name for f in files] == ["train-000000.tar", "train-000001.tar",
                                                 "train-000002.tar"]  # fmt: skip
        tars = TarShards(files, cache_dir=tmp_path / "ix1", info=read_info(server.url(
            "wds/_info.json")))  # fmt: skip
        assert tars.classes == ["a", "b", "c"]
        server.drops = 3
        got = tars.load_many(list(range(12)))
        assert server.drops == 0 and len(server.dropped) >= 6
        server.suffix = ".parquet"
        server.drops = 2
        pq_files = data_sources.split_files(server.url("parquet"), "train", "parquet")
        parquet = ParquetShards(pq_files)
        got_pq = [parquet[i] for i in range(12)]
    for i in range(12):
        assert torch.equal(got[i][0], local_tars[i][0]) and got[i][1] == local_tars[i][1]
        assert torch.equal(got_pq[i][0], local_pq[i][0]) and got_pq[i][1] == local_pq[i][1]


def test_http_server_that_keeps_dropping_is_named_never_skipped(written, tmp_path):
    with _Server(written) as server:
        url = server.url("wds/train-000001.tar")
        tars = TarShards([url], cache_dir=tmp_path / "ix")
        server.drops = 100
        factory = functools.partial(build_transform, "none")
        augmented = AugmentedDataset(tars, factory, True, skip_corrupt=True)
        with pytest.raises(remote_files.DataReadError) as err:
            augmented.__getitems__([(0, 0, 8), (1, 0, 8)])
    line = str(err.value)
    assert url in line and "member '00000005.jpg'" in line and "after 3 attempts" in line
    assert "\n" not in line


# ------------------------------------------------------------------------------------------------ #
# Corrupt members and malformed shards
# ------------------------------------------------------------------------------------------------ #


def _tar_with_bad_member(folder):
    folder.mkdir(parents=True)
    members = []
    for n in range(8):
        data = b"garbage, not an image" if n == 5 else _png(30 * n, 8)
        members += [(f"k{n}.png", data), (f"k{n}.cls", str(n % 2).encode())]
    return _tar(folder / "train-000000.tar", members)


def test_corrupt_member_is_named_and_skipped_only_under_skip_corrupt(tmp_path):
    shard = _tar_with_bad_member(tmp_path / "shards")
    tars = TarShards([str(shard)], cache_dir=tmp_path / "ix")
    with pytest.raises(CorruptImageError, match=f"cannot decode image k5.png of shard {shard}"):
        tars[5]
    factory = functools.partial(build_transform, "none")
    skipping = AugmentedDataset(tars, factory, True, skip_corrupt=True)
    batch = skipping.__getitems__([(4, 0, 8), (5, 0, 8)])
    assert isinstance(batch[1], Skipped) and f"k5.png of shard {shard}" in batch[1].reason
    with pytest.raises(CorruptImageError):
        AugmentedDataset(tars, factory, True).__getitems__([(5, 0, 8)])


def _cli(capsys, *args):
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


_TRAIN = [*TINY, "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1",
          "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]  # fmt: skip


def test_cli_corrupt_member_one_line_or_skipped_and_listed(tmp_path, capsys):
    shard = _tar_with_bad_member(tmp_path / "shards")
    pattern = str(tmp_path / "shards" / "train-{000000..000000}.tar")
    opts = ["DATA.PATH", pattern, "DATA.TEST_PATH", str(shard), "DATA_LOADER.INDEX_CACHE",
            str(tmp_path / "ix"), "DATA_LOADER.ORDER", "global"]  # fmt: skip
    status, _, err = _cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *_TRAIN, *opts,
                          "OUT_DIR", str(tmp_path / "a"))  # fmt: skip
    assert status == 2, err  # a corrupt input file: the input's fault (docs/trust.md)
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: cannot decode image k5.png of shard {shard}"), line
    assert "DATA_LOADER.SKIP_CORRUPT True" in line
    out = tmp_path / "b"
    status, _, err = _cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *_TRAIN, *opts,
                          "DATA_LOADER.SKIP_CORRUPT", "True", "OUT_DIR", str(out))  # fmt: skip
    assert status == 0, err
    listed = (out / checks.SKIPPED_FILES).read_text().splitlines()
    assert listed and listed[0].startswith(f"cannot decode image k5.png of shard {shard}")


@pytest.mark.parametrize(
    "members, why",
    [
        (None, "is not a readable tar file"),
        ([("a.png", b"x"), ("b.cls", b"1")], "sample 'a' has no label (cls or json)"),
        ([("a.cls", b"1")], "sample 'a' has no image (jpg, jpeg, png or webp)"),
        ([("a.png", b"x"), ("a.cls", b"1"), ("b.png", b"y"), ("a.json", b"{}")], "not together"),
        ("truncated", "is truncated: member 'a.png' ends at byte"),
    ],
)
def test_malformed_shard_refused_in_one_line_naming_it(tmp_path, members, why):
    path = tmp_path / "bad.tar"
    if members is None:
        path.write_text("this is not a tar file at all, but it is long enough " * 20)
    elif members == "truncated":
        _tar(path, [("a.png", np.random.default_rng(0).bytes(5000)), ("a.cls", b"0")])
        path.write_bytes(path.read_bytes()[:2000])
    else:
        _tar(path, members)
    with pytest.raises(CorruptFileError) as err:
        index_shard(str(path))
    assert str(path) in str(err.value) and why in str(err.value) and "\n" not in str(err.value)


def test_cli_malformed_shard_and_missing_test_path(tmp_path, capsys):
    bad = tmp_path / "shards" / "train-000000.tar"
    bad.parent.mkdir()
    bad.write_bytes(b"\0" * 100 + b"junk" * 300)
    base = ["--mode", "train", "--cfg", QUICKSTART, *_TRAIN, "OUT_DIR", str(tmp_path / "o"),
            "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix")]  # fmt: skip
    status, _, err = _cli(capsys, *base, "DATA.PATH", str(bad), "DATA.TEST_PATH", str(bad))
    (line,) = err.strip().splitlines()
    assert status == 2 and line.startswith(f"error: shard {bad} is not a readable tar"), line
    good = _numbered_shards(tmp_path / "good", [4])[0]
    status, _, err = _cli(capsys, *base, "DATA.PATH", good, "MODEL.NUM_CLASSES", "4")
    (line,) = err.strip().splitlines()
    assert status == 2 and line.startswith("config error: DATA.TEST_PATH: DATA.PATH"), line


# ------------------------------------------------------------------------------------------------ #
# Config: detection, keys
# ------------------------------------------------------------------------------------------------ #


def test_data_path_selects_the_reader_and_the_order(written, tmp_path):
    notes = []
    cfg = config.load_cfg(QUICKSTART, ["DATA.PATH", str(written / "wds")], notes=notes)
    assert cfg.DATA_LOADER.BACKEND == "wds" and cfg.DATA_LOADER.ORDER == "global"
    assert cfg.TRAIN.DATASET == cfg.TEST.DATASET == "imagefolder"
    assert any("holds WebDataset tar shards: DATA_LOADER.BACKEND wds" in n for n in notes)
    cfg = config.load_cfg(QUICKSTART, ["DATA.PATH", str(written / "parquet"),
                                       "TRAIN.DATASET", "cifar10"], notes=[])  # fmt: skip
    assert cfg.DATA_LOADER.BACKEND == "parquet" and cfg.DATA_LOADER.ORDER == "shards"
    assert cfg.TRAIN.DATASET == "cifar10" and cfg.TEST.DATASET == "imagefolder"
    cfg = config.load_cfg(QUICKSTART, ["DATA.PATH", "hf://datasets/x/y/train-{0..3}.tar"],
                          notes=[])  # fmt: skip
    assert cfg.DATA_LOADER.BACKEND == "wds" and cfg.DATA_LOADER.ORDER == "shards"
    with pytest.raises(config.ConfigError, match="^DATA_LOADER.ORDER: 'shards' reads shard"):
        config.load_cfg(QUICKSTART, ["DATA_LOADER.ORDER", "shards"])
    with pytest.raises(config.ConfigError, match="^DATA.PATH: BACKEND wds needs"):
        config.load_cfg(QUICKSTART, ["DATA_LOADER.BACKEND", "wds"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.tar").write_bytes(b"")
    (mixed / "b.parquet").write_bytes(b"")
    with pytest.raises(config.ConfigError, match="both .tar and .parquet"):
        config.load_cfg(QUICKSTART, ["DATA.PATH", str(mixed)])


def test_split_files_by_name_sub_folder_and_sibling(tmp_path):
    for name in ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                 "data/validation-00000-of-00001.parquet", "other/x.txt"]:  # fmt: skip
        (tmp_path / "hub" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "hub" / name).write_bytes(b"")
    hub = str(tmp_path / "hub")
    assert len(data_sources.split_files(hub, "train", "parquet")) == 2
    assert data_sources.split_files(hub, "val", "parquet")[0].endswith(
        "validation-00000-of-00001.parquet"
    )
    assert data_sources.split_files(hub, "test", "parquet")[0].endswith(
        "validation-00000-of-00001.parquet"
    )
    with pytest.raises(data_sources.DataSourceError, match="no .parquet file of split 'dev'"):
        data_sources.split_files(hub, "dev", "parquet")
    (tmp_path / "one" / "sub").mkdir(parents=True)
    for k in range(2):
        (tmp_path / "one" / "sub" / f"{k:04d}.tar").write_bytes(b"")
    assert len(data_sources.split_files(str(tmp_path / "one"), "train", "wds", whole=True)) == 2
    with pytest.raises(data_sources.DataSourceError):
        data_sources.split_files(str(tmp_path / "one"), "val", "wds")


# ------------------------------------------------------------------------------------------------ #
# Training end to end
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize("fmt", ["wds", "parquet"])
def test_trainer_stopped_mid_epoch_resumes_with_the_rest(written, tmp_path, fmt):
    """A run over the written shards stopped after 1 step of its first epoch: resumed with
    another batch size it trains the epoch's remaining samples; changing the shuffle buffer
    mid-epoch is refused naming the key."""
    from pycls import distributed as dist

    args = ["DATA.PATH", str(written / fmt), "DATA_LOADER.ORDER", "shards",
            "DATA_LOADER.SHUFFLE_BUFFER", "4", "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix"),
            "MODEL.NUM_CLASSES", "3", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
            "TRAIN.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1", "DEVICE", "cpu",
            "LOG_PERIOD", "1"]  # fmt: skip
    out = tmp_path / "run"
    t = trainer.Trainer(tiny_quickstart(out, *args), torch.device("cpu"))
    t.resume_or_init()
    t.preemption = StopRequested()
    with pytest.raises(dist.Preempted):
        t.train_epoch(0)
    full = [i for i, _, _ in t.train_loader.sampler]
    with pytest.raises(resume.ChangedEpochError, match="^DATA_LOADER.ORDER"):
        trainer.Trainer(tiny_quickstart(out, *args, "DATA_LOADER.SHUFFLE_BUFFER", "5"),
                        torch.device("cpu")).resume_or_init()  # fmt: skip
    resumed = trainer.Trainer(tiny_quickstart(out, *args, "TRAIN.BATCH_SIZE", "2"),
                              torch.device("cpu"))  # fmt: skip
    resumed.resume_or_init()
    assert resumed.start_iter == 2
    resumed.train_loader.sampler.set_epoch(0, skip=2 * 2)
    rest = [i for i, _, _ in resumed.train_loader.sampler]
    assert rest == full[4:]
    trainer.train_model(tiny_quickstart(out, *args, "TRAIN.BATCH_SIZE", "2"))
    assert json_stats_of(out, "resume") and json_stats_of(out, "test_epoch")
    assert builders.build_dataset(tiny_quickstart(out, *args), True).base.num_classes == 3


def test_prepare_tool_writes_both_conventions(tmp_path):
    """tools/prepare_dataset.py --format wds / parquet: the bundled digits, exact pixels (png)."""
    tool = load_tool("prepare_dataset")
    for fmt in ("wds", "parquet"):
        out = tmp_path / fmt
        assert tool.main(["--dataset", "digits", "--out", str(out), "--format", fmt,
                          "--workers", "1", "--shard-size", "1000"]) == 0  # fmt: skip
    digits = Digits("test")
    tars = TarShards(data_sources.split_files(str(tmp_path / "wds"), "test", "wds"),
                     cache_dir=tmp_path / "ix")  # fmt: skip
    parquet = ParquetShards(data_sources.split_files(str(tmp_path / "parquet"), "test", "parquet"))
    for shards in (tars, parquet):
        assert shards.labels.tolist() == digits.labels.tolist()
        assert torch.equal(shards[7][0], digits[7][0])
