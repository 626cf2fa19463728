"""Reading a config is pure; what it means on the machine that runs it is decided by one step
(``pycls.config.resolve_for_machine``), recorded in the config, and checked again."""

import os

import pytest
from PIL import Image

from pycls import config
from pycls import distributed as dist
from pycls.config import ConfigError
from pycls.core import trainer
from tests.helpers import QUICKSTART, json_stats_of


def test_reading_leaves_every_question_of_the_machine_open(tmp_path):
    # a folder that is not there: a config that looked at it while being read would fail
    opts = ["DATA.PATH", str(tmp_path / "none"), "DEVICE", "auto", "AMP.LEVEL", "O1"]
    cfg = config.read_cfg(QUICKSTART, opts)
    assert cfg.is_frozen()
    assert cfg.DEVICE == "auto" and cfg.AMP.CPU_LEVEL == "auto" and cfg.AMP.LEVEL == "O1"
    assert cfg.DATA_LOADER.BACKEND == "torchvision" and cfg.DATA_LOADER.ORDER == "auto"
    assert cfg.VIT.PACKED_ATTENTION == "auto"
    # the machine step is where DATA.PATH is looked at
    with pytest.raises(ConfigError, match="^DATA.PATH: .* does not exist"):
        config.resolve_for_machine(cfg)


def test_reading_asks_neither_the_environment_nor_a_server_nor_the_memory(monkeypatch):
    """A URL's ${VAR} secrets are looked up, the URL listed and the sizes held against this
    machine's memory by the machine step, never while the config is read (a config read on one
    machine to run on another needs none of them here)."""
    monkeypatch.delenv("PYCLS_TEST_UNSET", raising=False)
    options = '{"headers": {"Authorization": "Bearer ${PYCLS_TEST_UNSET}"}}'
    url = "http://127.0.0.1:9/data/"  # nothing listens there: a reading that listed it would fail
    opts = ["DATA.PATH", url, "DATA_LOADER.STORAGE_OPTIONS", options]
    cfg = config.read_cfg(QUICKSTART, opts)
    assert cfg.DATA_LOADER.BACKEND == "torchvision"  # DATA.PATH not looked at
    assert "${PYCLS_TEST_UNSET}" in cfg.DATA_LOADER.STORAGE_OPTIONS  # kept as written
    with pytest.raises(
        ConfigError, match="^DATA_LOADER.STORAGE_OPTIONS: .* PYCLS_TEST_UNSET is not"
    ):
        config.resolve_for_machine(cfg)
    cfg = config.read_cfg(QUICKSTART, ["DATA_LOADER.SHUFFLE_BUFFER", str(10**14)])
    with pytest.raises(ConfigError, match="^DATA_LOADER.SHUFFLE_BUFFER: .* this machine can order"):
        config.resolve_for_machine(cfg)


def test_the_machine_step_records_what_it_decided_and_changes_nothing_the_second_time():
    opts = ["DEVICE", "cpu", "AMP.LEVEL", "O1", "AMP.CPU_LEVEL", "O0"]
    written = config.read_cfg(QUICKSTART, opts)
    notes = []
    resolved = config.resolve_for_machine(written, notes)
    assert written.AMP.LEVEL == "O1" and written.AMP.CPU_LEVEL == "O0"  # the input is untouched
    assert resolved.is_frozen() and resolved is not written
    assert (resolved.DEVICE, resolved.AMP.LEVEL, resolved.AMP.CPU_LEVEL) == ("cpu", "O0", "same")
    assert resolved.DATA_LOADER.ORDER == "global" and resolved.VIT.PACKED_ATTENTION == "sdpa"
    assert notes and "AMP.LEVEL O1 runs as O0" in notes[0]
    config.assert_cfg(resolved)
    again = config.resolve_for_machine(resolved, notes := [])
    assert again == resolved and notes == []


def test_an_image_folder_in_data_path_is_found_by_the_machine_step(tmp_path):
    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = tmp_path / split / label
            os.makedirs(folder)
            Image.new("RGB", (8, 8)).save(folder / "0.png")
    written = config.read_cfg(QUICKSTART, ["DATA.PATH", str(tmp_path)])
    assert (written.TRAIN.DATASET, written.TEST.SPLIT) == ("digits", "test")  # as written
    resolved = config.resolve_for_machine(written)
    assert (resolved.TRAIN.DATASET, resolved.TEST.DATASET) == ("imagefolder", "imagefolder")
    assert resolved.TEST.SPLIT == "val"  # test/ is not there, val/ is


def test_the_vits_own_argument_check_refuses_at_load_what_the_key_checks_leave_out():
    """A sin-cos table needs a width divisible by 4: the model's record (VitArgs) says so when the
    config is read, naming the key, instead of the model failing when it is built."""
    with pytest.raises(ConfigError, match="^VIT.POS_EMBED: pos_embed 'sincos' needs width"):
        config.read_cfg(
            QUICKSTART, ["VIT.POS_EMBED", "sincos", "VIT.WIDTH", "18", "VIT.NUM_HEADS", "2"]
        )


def test_a_config_as_written_builds_what_its_keys_say():
    """A config read but not resolved (prepared here, run elsewhere) still builds: DATA_LOADER.ORDER
    auto stands for what it means for the backend as written."""
    from pycls.core import builders

    cfg = config.read_cfg(QUICKSTART, ["DATA_LOADER.NUM_WORKERS", "0", "TRAIN.BATCH_SIZE", "8"])
    assert cfg.DATA_LOADER.ORDER == "auto"
    assert builders.build_loader(cfg, train=True).sampler.order == "global"


def test_workers_above_the_cpus_run_as_that_many_and_train_the_same(tmp_path, monkeypatch):
    """Broke when the ImageNet configs' 10 loader workers started on a 2-core machine (torch
    warned twice) and nothing said so: a count above the CPUs each process has runs as that
    many, said in one note and recorded; the capped run's losses equal the uncapped run's (each
    sample's augmentation depends on its key, not on the worker that loads it)."""
    losses = {}
    for cpus in (1, 8):
        monkeypatch.setattr(dist, "available_cpus", lambda cpus=cpus: cpus)
        notes = []
        written = config.read_cfg(
            QUICKSTART,
            ["OPTIM.MAX_EPOCH", "1", "DATA_LOADER.NUM_WORKERS", "2", "AMP.CPU_LEVEL", "same",
             "VIT.DEPTH", "1", "VIT.WIDTH", "32", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64",
             "TRAIN.BATCH_SIZE", "64", "LOG_PERIOD", "5", "OUT_DIR", str(tmp_path / str(cpus))],
        )  # fmt: skip
        cfg = config.resolve_for_machine(written, notes)
        capped = [n for n in notes if "NUM_WORKERS" in n]
        assert min(2, cpus) == cfg.DATA_LOADER.NUM_WORKERS
        assert capped == ([] if cpus > 1 else [
            "DATA_LOADER.NUM_WORKERS 2 runs as 1: this machine gives each of the run's 1 "
            "process(es) 1 CPU(s), and more workers would only take turns on them (the samples "
            "and their augmentation are the same)"])  # fmt: skip
        trainer.train_model(cfg)
        losses[cpus] = [s["loss"] for s in json_stats_of(tmp_path / str(cpus), "train_iter")]
    assert len(losses[1]) >= 4 and losses[1] == losses[8]
