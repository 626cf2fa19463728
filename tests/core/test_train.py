"""End-to-end training: exact resume, every CLI mode, non-finite loss, outputs in OUT_DIR."""

import os
import sys

import pytest
import torch

from pycls import config
from pycls.checkpoint import single_file as checkpoint
from pycls.core import trainer
from pycls.core.logging import load_json_stats
from tests.helpers import (
    QUICKSTART,
    ROOT,
    TINY,
    json_stats_of,
    resume_from,
    scaled,
    tiny_quickstart,
)
from tests.helpers.warm import run as warm_run


def test_resumed_run_matches_uninterrupted_run(tmp_path):
    """Stopped after epoch 1 and resumed (with other worker settings) = never stopped, bitwise."""
    # Dropout and drop-path make the run depend on the restored RNG state too
    regs = [
        "VIT.DROPOUT",
        "0.1",
        "VIT.DROP_PATH",
        "0.1",
        "OPTIM.MAX_EPOCH",
        "3",
        "TRAIN.CHECKPOINT_PERIOD",
        "1",
        "TRAIN.EVAL_PERIOD",
        "1",
    ]
    full = tmp_path / "full"
    trainer.train_model(tiny_quickstart(full, *regs))
    resumed = tmp_path / "resumed"
    resume_from(full, resumed, epoch=1)
    trainer.train_model(tiny_quickstart(resumed, *regs, "DATA_LOADER.NUM_WORKERS", "2"))
    a = torch.load(checkpoint.get_checkpoint_path(str(full), 3), weights_only=True)
    b = torch.load(checkpoint.get_checkpoint_path(str(resumed), 3), weights_only=True)
    for key in a["model_state"]:
        assert torch.equal(a["model_state"][key], b["model_state"][key]), key
    for pid, state in a["optimizer_state"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer_state"]["state"][pid][name]), (pid, name)
    # The resumed run trained epochs 2 and 3 only, with the same losses
    full_epochs = json_stats_of(full, "train_epoch")
    resumed_epochs = json_stats_of(resumed, "train_epoch")
    assert [s["epoch_num"] for s in resumed_epochs] == [2, 3]
    assert [s["loss"] for s in full_epochs[1:]] == [s["loss"] for s in resumed_epochs]


def test_rerun_of_a_finished_run_evaluates_only(tmp_path):
    cfg = tiny_quickstart(tmp_path, "OPTIM.MAX_EPOCH", "1")
    first = trainer.train_model(cfg)
    again = trainer.train_model(cfg)
    assert again["top1_err"] == first["top1_err"]
    assert len(json_stats_of(tmp_path, "train_epoch")) == 1


def test_non_finite_loss_stops_without_a_bad_checkpoint(tmp_path):
    cfg = tiny_quickstart(
        tmp_path,
        "OPTIM.OPTIMIZER",
        "sgd",
        "OPTIM.BASE_LR",
        "1e12",
        "OPTIM.MAX_EPOCH",
        "2",
        "OPTIM.WARMUP_EPOCHS",
        "0",
        "OPTIM.MIN_LR",
        "0.0",
        "TRAIN.CHECKPOINT_PERIOD",
        "1",
    )
    with pytest.raises(FloatingPointError, match="loss is (nan|inf)"):
        trainer.train_model(cfg)
    assert checkpoint.get_last_checkpoint(str(tmp_path)) is None


def _run_net(*args, check=True):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "run_net.py"), *args]
    proc = warm_run(cmd, timeout=scaled(600))
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_cli_train_then_test(tmp_path):
    out = str(tmp_path / "run")
    _run_net("--mode", "train", "--cfg", QUICKSTART, *TINY, "OPTIM.MAX_EPOCH", "2", "OUT_DIR", out)
    for name in ("config.yaml", "stdout.log", "training_curves.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    kinds = {s["_type"] for s in load_json_stats(os.path.join(out, "stdout.log"))}
    assert {"complexity", "train_iter", "train_epoch", "test_epoch"} <= kinds
    train_iter = json_stats_of(out, "train_iter")[0]
    assert {"eta", "lr", "loss", "top1_err", "top5_err", "time_avg"} <= set(train_iter)
    last_test = json_stats_of(out, "test_epoch")[-1]
    # The resolved config is stored in the checkpoint, as YAML text
    ckpt = checkpoint.get_last_checkpoint(out)
    stored = config.cfg_from_yaml_text(torch.load(ckpt, weights_only=True)["cfg"])
    assert out == stored.OUT_DIR and stored.VIT.WIDTH == 32
    # --mode test on those weights reproduces the final evaluation exactly
    test_out = str(tmp_path / "test")
    _run_net(
        "--mode", "test", "--cfg", QUICKSTART, *TINY, "TEST.WEIGHTS", ckpt, "OUT_DIR", test_out
    )
    evaluated = json_stats_of(test_out, "test_epoch")[-1]
    assert evaluated["top1_err"] == last_test["top1_err"]
    assert evaluated["loss"] == pytest.approx(last_test["loss"], rel=1e-6)


def test_cli_info_vit_h16_has_about_632m_params():
    proc = _run_net("--mode", "info", "--cfg", os.path.join(ROOT, "configs", "vit_h16.yaml"))
    lines = [line for line in proc.stdout.splitlines() if "json_stats" in line]
    assert lines, proc.stdout
    import simplejson

    stats = simplejson.loads(lines[-1].split("json_stats: ", 1)[1])
    assert stats["_type"] == "complexity"
    assert 630e6 < stats["params"] < 634e6
    # 32 blocks x (12 L D^2 + 2 L^2 D) with L = 196, D = 1280, plus stem and head: 126.7 G
    assert 126e9 < stats["flops"] < 127.5e9
    assert "M params" in proc.stdout


def test_cli_bad_config_exits_with_the_key(tmp_path):
    proc = _run_net(
        "--mode",
        "train",
        "--cfg",
        QUICKSTART,
        "TRAIN.IM_SIZE",
        "30",
        "OUT_DIR",
        str(tmp_path),
        check=False,
    )
    assert proc.returncode == 2
    assert "TRAIN.IM_SIZE" in proc.stderr and "VIT.PATCH_SIZE=4" in proc.stderr
    assert not os.path.exists(os.path.join(str(tmp_path), "checkpoints"))


def test_compile_is_announced_and_kept_out_of_the_eta(tmp_path, monkeypatch):
    """A stand-in for torch.compile whose first call takes 2 s, as compiling does."""
    import time

    def slow_first_call(model, **kwargs):
        calls = []

        def run(*args, **kwargs):
            if not calls:
                calls.append(1)
                time.sleep(2.0)
            return model(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", slow_first_call)
    cfg = tiny_quickstart(
        tmp_path, "TRAIN.COMPILE", "True", "LOG_PERIOD", "4", "OPTIM.MAX_EPOCH", "1"
    )
    trainer.train_model(cfg)
    log = (tmp_path / "stdout.log").read_text()
    assert "compiling the model (TRAIN.COMPILE, scope blocks)" in log
    assert "compiled: first step 2." in log
    assert "note: on a CPU, compiled ViT steps measured no faster than eager" in log
    first = json_stats_of(tmp_path, "train_iter")[0]
    assert first["iter"].startswith("4/") and first["time_avg"] < 0.25, first  # 2 s / 4 without
