"""A run is one way: what DATA.PATH holds is decided once, by the machine step, recorded in the
config (DATA.SOURCE, so in config.yaml) and handed down to the data builders, which list nothing
again and ask the config's data section nothing about how to read it. Followed through the calls
(tests/helpers/call_trace.py), the path goes back up the layers of tests/test_layers.py at most
twice while a run's data is found and built: a local image folder, a folder of tar shards, and
the same shards at a URL on a server of this process."""

import contextlib
import os
import shutil

import pytest
import torch
from PIL import Image

from pycls import config
from pycls.config import data_source
from pycls.core.builders import data_builders
from pycls.datasets.formats import data_sources
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.datasets.transport import remote_files
from tests.helpers import QUICKSTART, TINY
from tests.helpers.call_trace import LayerTrace
from tests.helpers.data_servers import Server

WHERE = ["image folder", "tar folder", "url"]


class _Four:
    """Four 8 px images of two classes (a source for the tar writer)."""

    classes, num_classes, labels = ["a", "b"], 2, [0, 1, 0, 1]

    def __len__(self):
        return 4

    def __getitem__(self, k):
        return torch.full((3, 8, 8), 40 * k, dtype=torch.uint8), k % 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """images/ (train/ and val/ of two class folders) and wds/ (train and val tar shards)."""
    root = tmp_path_factory.mktemp("data")
    for split in ("train", "val"):
        for name in ("a", "b"):
            os.makedirs(root / "images" / split / name)
            for i in range(2):
                Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(
                    root / "images" / split / name / f"{i}.png"
                )
        write_webdataset(_Four(), root / "wds", split=split, shard_size=2, encoding="png")
    return root


@contextlib.contextmanager
def _data_path(data, where):
    """DATA.PATH of ``where``: the folder, or the shards' folder served over HTTP."""
    if where != "url":
        yield str(data / ("images" if where == "image folder" else "wds"))
        return
    with Server(data) as server:
        yield server.url("wds/")


def _cfg(path, tmp_path):
    opts = ["DATA.PATH", path, "DATA_LOADER.NUM_WORKERS", "0", "TRAIN.BATCH_SIZE", "2",
            "TEST.BATCH_SIZE", "2", "MODEL.NUM_CLASSES", "2", "OUT_DIR", str(tmp_path / "run"),
            "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix")]  # fmt: skip
    return config.read_cfg(QUICKSTART, [*TINY, *opts])


def _resolved(cfg):
    """The machine step as the command line takes it: found before torch loads, then resolved."""
    source = data_source.find_data_source(cfg)
    data_source.require_readable(cfg, source)
    return config.resolve_for_machine(cfg, [], source)


def _build(cfg):
    """A run's data: both splits built and a training batch loaded."""
    train = data_builders.build_dataset(cfg, True)
    data_builders.build_dataset(cfg, False)
    images, labels, _ = next(iter(data_builders.build_loader(cfg, True, train)))
    assert images.shape[0] == labels.shape[0] == 2


@pytest.mark.parametrize("where", WHERE)
def test_data_path_goes_back_up_the_layers_at_most_twice(data, where, tmp_path):
    """Broke (shards in a folder and at a URL) when the data builder listed DATA.PATH again and
    asked the config's data section how to read it (``url_access``), and the machine step handed
    the path back and forth between the config and the readers."""
    with _data_path(data, where) as path:

        def carries(value):
            is_path = isinstance(value, str) and value.startswith(path.rstrip("/"))
            return is_path or isinstance(value, data_sources.DataSource)

        with LayerTrace(carries) as trace:
            _build(_resolved(_cfg(path, tmp_path)))
    layers = {step.module.split(".")[1] for step in trace.steps}
    assert {"config", "datasets"} <= layers, layers  # the path was followed
    assert len(trace.climbs()) <= 2, trace.describe()


@pytest.mark.parametrize("where", WHERE)
def test_a_run_started_from_its_own_config_yaml_lists_nothing_and_finds_the_same(
    data, where, tmp_path, monkeypatch
):
    """config.yaml records what DATA.PATH held (DATA.SOURCE): read back, the machine step takes
    it (same source, same resolved config) and the builders read the recorded files, with every
    way of listing a folder refused. Broke when the source was not recorded: an image folder was
    scanned at every start, a folder of shards listed again by the builder of every process."""
    with _data_path(data, where) as path:
        resolved = _resolved(_cfg(path, tmp_path))
        written = config.read_cfg(config.dump_cfg(resolved))
        source = data_source.find_data_source(resolved)

        def listed(*args, **kwargs):
            raise AssertionError("DATA.PATH listed again")

        with monkeypatch.context() as m:
            for module, name in [(remote_files, "list_files"), (remote_files, "glob_files"),
                                 (remote_files, "isdir"), (os, "scandir")]:  # fmt: skip
                m.setattr(module, name, listed)
            assert data_source.find_data_source(written) == source
            assert config.resolve_for_machine(written, [], source) == resolved
        if where != "image folder":  # an image folder's reader scans its split: it reads it
            monkeypatch.setattr(remote_files, "list_files", listed)
            monkeypatch.setattr(remote_files, "glob_files", listed)
        _build(config.resolve_for_machine(written))
    assert written.DATA.SOURCE == resolved.DATA.SOURCE != ""


def test_a_record_for_another_path_or_split_is_looked_for_again(data, tmp_path):
    """A config.yaml whose DATA.PATH or TEST.SPLIT was changed since is not held to the old
    record: what the new path holds is found (broke if the record were taken whatever it was
    found for)."""
    resolved = _resolved(_cfg(str(data / "wds"), tmp_path))
    moved = resolved.clone()
    moved.defrost()
    moved.DATA.PATH = str(shutil.copytree(data / "wds", tmp_path / "moved"))
    files, _ = data_source.find_data_source(moved).split_files("train")
    assert files and all(f.startswith(moved.DATA.PATH) for f in files)
    moved.DATA.PATH, moved.TEST.SPLIT = resolved.DATA.PATH, "train"
    files, _ = data_source.find_data_source(moved).split_files("test")
    assert files and all("train-" in f for f in files)
