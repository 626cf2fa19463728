"""Reading data from HTTP servers of both kinds: one that serves byte ranges and one that ignores
them (a handler written so on purpose, and Python's own ``http.server``). The second is found
out on its first answer and said once; its shards are streamed whole, exactly the samples of
disk; a random order over it is refused naming the key; a run over it stopped mid-epoch resumes
bitwise with 2 loader workers; parquet is read whole when it fits the read-ahead bound and
refused when not. A read that fails or stalls is logged with the URL, the attempt and the wait.
The servers are tiny ones on 127.0.0.1 in threads of this process."""

import functools
import io
import json
import logging
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from pycls import distributed as dist
from pycls.config import ConfigError
from pycls.core import builders, trainer
from pycls.datasets import AugmentedDataset, build_transform, construct_loader
from pycls.datasets.formats import data_sources
from pycls.datasets.formats.parquet_shards import ParquetShards
from pycls.datasets.formats.parquet_writer import write_parquet
from pycls.datasets.formats.synthetic import Synthetic
from pycls.datasets.formats.tar_index import index_shard
from pycls.datasets.formats.tar_shards import TarShards, read_info
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.datasets.transport import read_attempts, remote_files
from pycls.datasets.transport.remote_files import Access
from tests.helpers import free_port, scaled, tiny_quickstart, within
from tests.helpers.data_servers import NoRangeHandler, RangeHandler, Server, StdlibHandler

DETECTED = "serves no byte ranges"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """16 small images in 4 tar shards and 2 parquet files, train and val."""
    root = tmp_path_factory.mktemp("served")
    for split, seed in (("train", 0), ("val", 1)):
        images = Synthetic(16, 12, 4, seed=seed)
        write_webdataset(images, root / "wds", split=split, shard_size=4, encoding="png")
        write_parquet(images, root / "parquet", split=split, shard_size=8, encoding="png")
    return root


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(read_attempts, "RETRY_PAUSE", 0.01)


def _local(data, fmt="wds"):
    files = data_sources.split_files(str(data / fmt), "train", fmt)
    if fmt == "wds":
        return TarShards(files, cache_dir=data / "ix-local")
    return ParquetShards(files)


def _same(got, local, indices):
    return all(torch.equal(g[0], local[i][0]) and g[1] == local[i][1] for g, i in zip(got, indices))


@pytest.mark.parametrize("handler", [NoRangeHandler, StdlibHandler])
def test_a_server_without_ranges_is_said_once_and_its_shards_streamed_whole(
    data, tmp_path, caplog, handler
):
    with Server(data, handler) as server, caplog.at_level(logging.WARNING):
        files = data_sources.split_files(server.url("wds/"), "train", "wds")
        tars = TarShards(files, cache_dir=tmp_path / "ix")
        order = [13, 2, 7, 0, 15, 4, 9, 11]
        got = tars.load_many(order)
        got += tars.load_many([1, 3])
        asked = dict(server.requests)
    assert not tars.serves_ranges and _same(got, _local(data), order + [1, 3])
    lines = [r.getMessage() for r in caplog.records if DETECTED in r.getMessage()]
    assert len(lines) == 1 and "status 200 and the whole file" in lines[0], lines
    # Each shard: one answer to index it, one to read what the batches took of it (and the
    # first shard the answer that found the server out)
    if handler is NoRangeHandler:
        assert len(asked) == 4 and sum(asked.values()) <= 2 * 4 + 1, asked


def test_a_random_order_over_it_is_refused_naming_the_key(data, tmp_path):
    with Server(data, NoRangeHandler) as server:
        keys = ["DATA.PATH", server.url("wds/"), "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix"),
                "MODEL.NUM_CLASSES", "4"]  # fmt: skip
        with pytest.raises(ConfigError) as err:
            builders.build_dataset(tiny_quickstart(tmp_path, *keys, "DATA_LOADER.ORDER",
                                                   "global"), True)  # fmt: skip
        assert builders.build_dataset(tiny_quickstart(tmp_path, *keys), True).base.num_classes == 4
    line = str(err.value)
    assert line.startswith("DATA_LOADER.ORDER: global") and "serves no byte ranges" in line
    assert "set DATA_LOADER.ORDER shards" in line and "\n" not in line


class _Stop:
    """A preemption flag already raised: the run checkpoints at its first sync point."""

    requested, interrupted = True, False


def test_a_run_over_it_stopped_mid_epoch_resumes_bitwise_with_two_workers(data, tmp_path):
    with Server(data, NoRangeHandler) as server:
        keys = ["DATA.PATH", server.url("wds/"), "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix"),
                "DATA_LOADER.NUM_WORKERS", "2", "DATA_LOADER.SHUFFLE_BUFFER", "6",
                "MODEL.NUM_CLASSES", "4", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
                "TRAIN.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1", "LOG_PERIOD", "1",
                "DEVICE", "cpu"]  # fmt: skip
        trainer.train_model(tiny_quickstart(tmp_path / "whole", *keys))
        cfg = tiny_quickstart(tmp_path / "stopped", *keys)
        stopped = trainer.Trainer(cfg, trainer.setup_env(cfg, write_config=False))
        stopped.resume_or_init()
        stopped.preemption = _Stop()
        with pytest.raises(dist.Preempted):
            stopped.train_epoch(0)
        del stopped
        trainer.train_model(tiny_quickstart(tmp_path / "stopped", *keys))
    whole = load_file(tmp_path / "whole" / "model_final.safetensors")
    resumed = load_file(tmp_path / "stopped" / "model_final.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def _numbered_shards(folder, sizes):
    """Tar shards whose sample n (counted across shards) has label n."""
    folder.mkdir(parents=True)
    n, files = 0, []
    for k, size in enumerate(sizes):
        with tarfile.open(folder / f"train-{k:06d}.tar", "w") as tar:
            for _ in range(size):
                png = io.BytesIO()
                Image.new("RGB", (4, 4), (n, 0, 0)).save(png, format="PNG")
                for name, data in (
                    (f"s{n:04d}.png", png.getvalue()),
                    (f"s{n:04d}.cls", str(n).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                n += 1
        files.append(folder / f"train-{k:06d}.tar")
    return files


def _rank_epochs(rank, port, sources, out):
    """Each source's labels, batch by batch, that this rank of 2 loads in epochs 0 and 1 with 2
    loader workers, ORDER shards."""
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=2)  # fmt: skip
    seen = {}
    for name, shards in sources.items():
        base = TarShards(shards, cache_dir=Path(out).parent / f"ix-{name}", window=5)
        dataset = AugmentedDataset(base, functools.partial(build_transform, "none"), True)
        loader = construct_loader(
            dataset, batch_size=3, shuffle=True, drop_last=True, num_workers=2, pin_memory=False,
            persistent_workers=False, prefetch_factor=2, seed=0, image_size=4, rank=rank,
            world_size=2, order="shards", shuffle_buffer=5,
        )  # fmt: skip
        seen[name] = []
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch)
            seen[name].append([labels.tolist() for _, labels, _ in loader])
    gathered = [None, None]
    tdist.all_gather_object(gathered, seen)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    tdist.destroy_process_group()


@pytest.mark.parametrize("handler", [NoRangeHandler, RangeHandler])
def test_two_gloo_processes_with_two_workers_each_load_over_http_what_they_load_from_disk(
    tmp_path, handler
):
    local = [str(f) for f in _numbered_shards(tmp_path / "shards", [7, 7, 7, 5])]
    out = tmp_path / "seen.json"
    with Server(tmp_path, handler) as server:
        urls = [server.url(f"shards/{Path(f).name}") for f in local]
        torch.multiprocessing.start_processes(
            _rank_epochs, args=(free_port(), {"disk": local, "http": urls}, str(out)), nprocs=2,
            start_method="fork",
        )  # fmt: skip
    ranks = json.loads(out.read_text())
    for rank in ranks:
        assert rank["http"] == rank["disk"] and len(rank["disk"][0]) == 4
    for epoch in (0, 1):
        flat = [k for rank in ranks for batch in rank["http"][epoch] for k in batch]
        assert len(flat) == len(set(flat)) == 24


def test_parquet_over_it_is_read_whole_when_it_fits_else_refused(data):
    local = _local(data, "parquet")
    with Server(data, NoRangeHandler) as server:
        files = data_sources.split_files(server.url("parquet/"), "train", "parquet")
        parquet = ParquetShards(files)
        got = parquet.load_many(list(range(16)))
        assert not parquet.serves_ranges and _same(got, local, range(16))
        small = remote_files.Access(readahead_bytes=1000)
        with pytest.raises(remote_files.DataPathError) as err:
            ParquetShards(files, access=small)
    line = str(err.value)
    assert any(f in line for f in files) and "served without byte ranges" in line
    assert "DATA_LOADER.READAHEAD_MB" in line and "\n" not in line


def test_a_server_with_ranges_is_read_by_ranges_and_not_said(data, tmp_path, caplog):
    with Server(data, RangeHandler) as server, caplog.at_level(logging.WARNING):
        files = data_sources.split_files(server.url("wds/"), "train", "wds")
        tars = TarShards(files, cache_dir=tmp_path / "ix")
        got = tars.load_many([5, 14, 6])
        ranged = sum(n for (_, by_range), n in server.requests.items() if by_range)
    assert tars.serves_ranges and _same(got, _local(data), [5, 14, 6])
    assert ranged >= 2 and not any(DETECTED in r.getMessage() for r in caplog.records)


def test_a_failed_read_is_logged_with_url_attempt_and_pause_then_read(data, tmp_path, caplog):
    with Server(data, RangeHandler, script=[503], scripted="train-000002.tar") as server:
        url = server.url("wds/train-000002.tar")
        tars = TarShards([url], cache_dir=tmp_path / "ix")
        server.script = [503, 502]
        caplog.clear()  # what the indexing met: its first answer was a 503 too
        with caplog.at_level(logging.WARNING):
            got = tars.load_many([0, 3])
    assert _same(got, _local(data), [8, 11])
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == 2 and all(url in line for line in retries), retries
    assert "attempt 1 of 3: the server answered HTTP 503" in retries[0]
    assert "attempt 2 of 3" in retries[1] and "trying again in 0.02 s" in retries[1]


def test_indexing_a_shard_over_a_failing_server_tries_each_read_retries_times_not_more(data):
    """The stream that indexes a shard tries its reads DATA_LOADER.RETRIES times; indexing does
    not start the stream over that many times again (retries squared, each up to a minute)."""
    with Server(data, RangeHandler, scripted="train-000003.tar") as server:
        url = server.url("wds/train-000003.tar")
        remote_files.file_size(url, 3)  # the size is asked first; then every GET fails
        server.script = [503] * 20
        with pytest.raises(remote_files.DataReadError, match="after 3 attempts"):
            index_shard(url, 3)
        answered = 20 - len(server.script)
    assert answered == 3


def test_a_read_that_stalls_is_logged_while_it_waits_then_retried(
    data, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(remote_files, "STALL_SECONDS", 0.1)
    with Server(data, RangeHandler) as server:
        url = server.url("wds/train-000001.tar")
        tars = TarShards([url], cache_dir=tmp_path / "ix", access=Access(read_timeout=0.6))
        server.script, server.scripted = ["stall"], ".tar"
        with caplog.at_level(logging.WARNING):
            got = tars.load_many([1, 2])
    assert _same(got, _local(data), [5, 6])
    messages = [r.getMessage() for r in caplog.records]
    stalls = [m for m in messages if "has waited" in m]
    assert stalls and url in stalls[0] and "on attempt 1 of 3" in stalls[0], messages
    assert any("attempt 1 of 3: no answer from 127.0.0.1" in m and "timed out" in m
               for m in messages), messages  # fmt: skip


@pytest.mark.parametrize("trouble", [500, "drop", "trickle"])
def test_every_whole_file_read_is_retried_by_the_one_policy(data, tmp_path, caplog, trouble):
    """_info.json and a whole shard (read whole: what a batch draws from fits READAHEAD_MB) each
    meet one 500, one connection dropped mid-answer or one trickle, and are read at the next
    attempt, each failure logged. Before, a whole-file read had one attempt: a single 500 on
    _info.json ended the run."""
    floor = {"read_timeout": 1.0, "min_rate": 1024} if trouble == "trickle" else {}
    access = remote_files.Access(**floor)
    with Server(data, RangeHandler) as server:
        server.trickle_for = 60
        info_url = server.url("wds/_info.json")
        server.script, server.scripted = [trouble], "_info.json"
        server.picks = lambda path, handler: path.endswith(server.scripted) and (
            handler.command == "GET")  # fmt: skip
        info = read_info(info_url, 3, access)
        url = server.url("wds/train-000002.tar")
        tars = TarShards([url], cache_dir=tmp_path / "ix", access=access, window=None)
        assert tars._reader.whole_files
        server.script, server.scripted = [trouble], "train-000002.tar"
        got = within(scaled(30), lambda: tars.load_many([0, 3]))
    assert info["splits"] and not isinstance(got, BaseException), got
    assert _same(got, _local(data), [8, 11])
    failed = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(failed) == 2 and info_url in failed[0] and url in failed[1], failed
    assert all("attempt 1 of 3" in line for line in failed)


class _ListingHandler(RangeHandler):
    """The wds/ folder's page also links to a shard outside it, its '..' percent-encoded."""

    def list_directory(self, path):
        if not self.path.rstrip("/").endswith("wds"):
            return super().list_directory(path)
        names = sorted(os.listdir(path))
        links = [*names, "%2e%2e/outside/train-000009.tar", "..%2foutside/train-000008.tar",
                 "sub/%2E%2E/%2e%2e/outside/train-000007.tar"]  # fmt: skip
        body = "".join(f'<a href="{n}">{n}</a>' for n in links).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)


def test_a_listing_link_that_climbs_out_percent_encoded_is_left_out(data, tmp_path):
    """A folder's page is compared decoded and normalised: '%2e%2e/' is '..' to the server
    (Python's http.server served a shard from outside the listed folder this way, and it was
    trained with the others). The other links are listed as before."""
    outside = tmp_path / "root"
    shutil.copytree(data / "wds", outside / "wds")
    (outside / "outside").mkdir()
    for n in (7, 8, 9):
        shutil.copy(data / "wds" / "train-000000.tar", outside / "outside" / f"train-00000{n}.tar")
    with Server(outside, _ListingHandler) as server:
        files = remote_files.list_files(server.url("wds/"), max_depth=1)
        found = data_sources.split_files(server.url("wds/"), "train", "wds")
        asked = {path for path, _ in server.requests}
    assert files and all(f.startswith(server.url("wds/")) for f in files), files
    assert found == [server.url(f"wds/train-00000{i}.tar") for i in range(4)]
    assert not any("outside" in path for path in asked)
