"""A run is one way: what DATA.PATH holds is decided once, by the machine step, recorded in the
config (DATA.SOURCE, so in config.yaml) and handed down to the data builders, which list nothing
again and ask the config's data section nothing about how to read it; a resume's checkpoint is
read once and the point it leaves the run at decided in one module, which the Trainer applies; a
teacher's weights file is opened once, its kind and reader decided there. Followed through the
calls (tests/helpers/call_trace.py), each goes back up the layers of tests/test_layers.py at most
twice: DATA.PATH as a local image folder, a folder of tar shards and the same shards at a URL on
a server of this process; a resume; a teacher's safetensors, run folder, sharded folder and timm
weights."""

import contextlib
import os
import shutil

import pytest
import torch
from PIL import Image

from pycls import config
from pycls.checkpoint import sharded
from pycls.checkpoint.opened_weights import OpenedWeights
from pycls.config import data_source
from pycls.core import builders, resume_point
from pycls.core.builders import data_builders
from pycls.core.trainer import Trainer, setup_env, train_model
from pycls.datasets.formats import data_sources
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.datasets.transport import remote_files
from tests.helpers import QUICKSTART, TINY, tiny_quickstart
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


# ---- a resume and a teacher's weights ---------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run of one epoch: its checkpoint after the epoch and its model_final.safetensors."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train_model(tiny_quickstart(out, "OPTIM.MAX_EPOCH", "1", "TRAIN.CHECKPOINT_PERIOD", "1"))
    return out


def _under(root):
    """What a trace follows for the files below ``root``: a path that names one of them (a
    message's label that starts with it is not a path), the opened file, a resume point."""

    def carries(value):
        if isinstance(value, (OpenedWeights, resume_point.ResumePoint)):
            return True
        return isinstance(value, str) and value.startswith(str(root)) and os.path.exists(value)

    return carries


def test_a_resume_goes_back_up_the_layers_at_most_twice(trained, tmp_path):
    """The resume point is decided in core/resume_point.py from the checkpoint read once below it,
    then applied by the Trainer. Broke (5 climbs) when the resume went from the checkpoint's
    reader up to the config checks, down to checkpoint/resume.py's refusal, up to the teacher's
    check, down for the steps into the epoch, up to build the point, and the engine asked again
    whether the checkpoint is a folder."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    cfg = tiny_quickstart(run, "OPTIM.MAX_EPOCH", "2")
    trainer = Trainer(cfg, setup_env(cfg, write_config=False))
    with LayerTrace(_under(run)) as trace:
        trainer.resume_or_init()
    assert trainer.start_epoch == 1  # it resumed
    assert {"checkpoint", "core", "engines"} <= {s.module.split(".")[1] for s in trace.steps}
    assert len(trace.climbs()) <= 2, trace.describe()


def _timm_weights(tmp_path):
    """A timm ViT's state dict in timm's naming (a teacher as DeiT gives one) and its name."""
    import timm  # the test of a timm teacher needs timm (installed with the dev extra)

    model = timm.create_model(TIMM_TEACHER, pretrained=False, num_classes=10)
    path = tmp_path / "teacher.pth"
    torch.save({"model": model.state_dict()}, path)
    return path


TIMM_TEACHER = "vit_tiny_patch16_224"


def _sharded_teacher(tmp_path):
    """A sharded checkpoint folder (torch.distributed.checkpoint, sealed) of the tiny model."""
    cfg = tiny_quickstart(tmp_path / "unused")
    model = builders.build_model(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return sharded.save_sharded(str(tmp_path / "sharded"), 1, module=model, optimizer=optimizer,
                                cfg_yaml=cfg.dump())  # fmt: skip


@pytest.mark.parametrize(
    "kind", ["pycls safetensors", "pycls checkpoint", "sharded folder", "timm naming"]
)
def test_a_teachers_weights_go_back_up_the_layers_at_most_twice(trained, kind, tmp_path):
    """A teacher's file is opened once (checkpoint/opened_weights.py: its kind decided, its config
    and tensor shapes read), the model built above it and loaded by the reader its kind chose.
    Broke (3 climbs: a pycls safetensors file, a run folder, a sharded folder; a timm teacher's
    file kept within two) when the model builders asked checkpoint/ which checkpoint a run folder
    stands for, came back up, asked again for the metadata and the shapes, came back up to check
    them, then asked checkpoint/ again for the file's digest."""
    teacher, weights = {
        "pycls safetensors": lambda: (trained / "model_final.safetensors", ""),
        "pycls checkpoint": lambda: (trained, ""),
        "sharded folder": lambda: (_sharded_teacher(tmp_path), ""),
        "timm naming": lambda: (f"timm:{TIMM_TEACHER}", _timm_weights(tmp_path)),
    }[kind]()
    cfg = tiny_quickstart(tmp_path / "student", "DISTILL.TYPE", "hard", "DISTILL.TEACHER",
                          str(teacher), "DISTILL.TEACHER_WEIGHTS", str(weights))  # fmt: skip
    cpu = torch.device("cpu")
    root = tmp_path if weights or kind == "sharded folder" else trained
    with LayerTrace(_under(root)) as trace:
        built = builders.build_teacher(cfg, cpu, builders.build_precision(cfg, cpu))
    assert built.identity["sha256"] and os.path.exists(built.identity["file"])
    assert {"checkpoint", "core"} <= {s.module.split(".")[1] for s in trace.steps}
    assert len(trace.climbs()) <= 2, trace.describe()
