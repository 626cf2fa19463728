"""The config tree: documentation of every key, validation errors that name the key."""

import glob
import os
import re

import pytest
from helpers import ROOT

from pycls import config
from pycls.config import ConfigError, load_cfg


def _all_keys(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _all_keys(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_every_key_is_documented_where_it_is_defined():
    with open(os.path.join(ROOT, "pycls", "config", "defaults.py")) as f:
        lines = f.read().splitlines()
    assignment = re.compile(r"^_C\.([A-Z0-9_.]+) = ")
    documented = set()
    for i, line in enumerate(lines):
        m = assignment.match(line)
        if not m or line.rstrip().endswith("CfgNode()"):
            continue
        j = i - 1
        while j >= 0 and assignment.match(lines[j]):  # a run of keys shares one comment
            j -= 1
        if lines[j].startswith("#"):
            documented.add(m.group(1))
    missing = sorted(set(_all_keys(config.get_default_cfg())) - documented)
    assert not missing, f"keys without a comment above their definition: {missing}"


def test_defaults_are_valid():
    config.assert_cfg(config.get_default_cfg())


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))
)
def test_shipped_configs_load(path):
    if os.sep + "sweeps" + os.sep in path:
        pytest.skip("sweep files have their own schema")
    cfg = load_cfg(path, ["DATA.PATH", "/data"])
    assert cfg.is_frozen()


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["TRAIN.NOT_A_KEY", "1"], "TRAIN.NOT_A_KEY", "unknown config key"),
        (["TRAIN.IM_SIZE", "big"], "TRAIN.IM_SIZE", "wrong type"),
        (["VIT.LAYOUT", "nchw"], "VIT.LAYOUT", "'batch_first', 'batch_second'"),
        (["AMP.LEVEL", "O4"], "AMP.LEVEL", "'O0', 'O1', 'O2', 'O3'"),
        (["TRAIN.IM_SIZE", "230"], "TRAIN.IM_SIZE", "not divisible by VIT.PATCH_SIZE=16"),
        (["VIT.NUM_HEADS", "7"], "VIT.WIDTH", "not divisible by VIT.NUM_HEADS=7"),
        (["TRAIN.BATCH_SIZE", "0"], "TRAIN.BATCH_SIZE", "must be > 0"),
        (["OPTIM.BASE_LR", "-0.1"], "OPTIM.BASE_LR", "must be >= 0"),
        (["OPTIM.BETAS", "[0.9]"], "OPTIM.BETAS", "two values"),
        (["OPTIM.LR_POLICY", "steps"], "OPTIM.STEPS", "at least one step"),
        (["TRAIN.DATASET", "imagefolder"], "DATA.PATH", "needs a data folder"),
        (["DATA_LOADER.BACKEND", "shards"], "DATA_LOADER.SHARD_PATH", "needs the folder"),
        (
            ["DATA_LOADER.AUGMENT_DEVICE", "gpu", "DEVICE", "cpu"],
            "DATA_LOADER.AUGMENT_DEVICE",
            "needs a CUDA device",
        ),
        (
            [
                "VIT.STEM_TYPE",
                "conv",
                "VIT.C_STEM_STRIDES",
                "[2, 2, 2]",
                "VIT.C_STEM_CHANNELS",
                "[8, 8, 8]",
                "VIT.C_STEM_KERNELS",
                "[3, 3, 3]",
            ],
            "VIT.C_STEM_STRIDES",
            "must equal VIT.PATCH_SIZE",
        ),
        (["MODEL.ARCH", "vit_z99"], "MODEL.ARCH", "vit_b16"),
        (["VIT.DROP_PATH", "1.5"], "VIT.DROP_PATH", "must be < 1"),
    ],
)
def test_bad_values_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_cfg(None, overrides)
    assert str(e.value).startswith(key), str(e.value)
    assert words in str(e.value), str(e.value)


def test_bad_yaml_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("OPTIM:\n  BASE_LR: 0.1\n  MOMENTUMM: 0.9\n")
    with pytest.raises(ConfigError, match="OPTIM.MOMENTUMM"):
        load_cfg(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_cfg(str(tmp_path / "missing.yaml"))


def test_bundled_configs_by_name_and_a_real_path_wins(tmp_path, monkeypatch):
    bundled = os.path.join(ROOT, "configs", "vit_b16.yaml")
    for name in ("vit_b16", "vit_b16.yaml", "configs/vit_b16.yaml"):
        assert os.path.samefile(config.resolve_cfg_file(name), bundled), name
    assert load_cfg("cifar/vit_ti4_cifar10").TRAIN.DATASET == "cifar10"
    monkeypatch.chdir(tmp_path)  # a file of the same name in the working folder wins
    (tmp_path / "vit_b16.yaml").write_text("OPTIM:\n  BASE_LR: 0.123\n")
    assert load_cfg("vit_b16.yaml").OPTIM.BASE_LR == 0.123
    assert load_cfg("vit_b16").OPTIM.BASE_LR != 0.123  # no such file here: the bundled one
    with pytest.raises(ConfigError, match="nor is it a bundled config .*quickstart"):
        load_cfg("no_such_config")


def test_integers_are_accepted_for_float_keys(tmp_path):
    path = tmp_path / "ints.yaml"
    path.write_text("OPTIM:\n  BASE_LR: 1\n  MIN_LR: 0\n")
    cfg = load_cfg(str(path), ["OPTIM.WEIGHT_DECAY", "0"])
    assert cfg.OPTIM.BASE_LR == 1.0 and isinstance(cfg.OPTIM.BASE_LR, float)
    assert cfg.OPTIM.WEIGHT_DECAY == 0.0 and isinstance(cfg.OPTIM.WEIGHT_DECAY, float)


def test_arch_fills_the_vit_sizes():
    cfg = load_cfg(None, ["MODEL.ARCH", "vit_h14"])
    assert (cfg.VIT.PATCH_SIZE, cfg.VIT.DEPTH, cfg.VIT.WIDTH) == (14, 32, 1280)
    assert (cfg.VIT.NUM_HEADS, cfg.VIT.MLP_DIM) == (16, 5120)


def test_explicit_vit_keys_win_over_the_arch_preset(tmp_path):
    ti16 = os.path.join(ROOT, "configs", "vit_ti16.yaml")
    cfg = load_cfg(ti16, ["VIT.DEPTH", "6"])  # a 6-block ViT-Ti, not a 12-block one
    assert (cfg.MODEL.ARCH, cfg.VIT.DEPTH, cfg.VIT.WIDTH, cfg.VIT.NUM_HEADS) == (
        "vit_ti16",
        6,
        192,
        3,
    )
    path = tmp_path / "arch.yaml"
    path.write_text("VIT:\n  WIDTH: 96\n")  # a file's VIT key wins over an ARCH given later too
    cfg = load_cfg(str(path), ["MODEL.ARCH", "vit_s16"])
    assert (cfg.VIT.WIDTH, cfg.VIT.DEPTH, cfg.VIT.NUM_HEADS) == (96, 12, 6)
    # the resolved config written to OUT_DIR reloads to itself
    cfg = load_cfg(ti16, ["VIT.DEPTH", "6", "OUT_DIR", str(tmp_path)])
    assert load_cfg(config.dump_cfg(cfg)) == cfg


def test_dump_round_trip(tmp_path):
    cfg = load_cfg(os.path.join(ROOT, "configs", "quickstart.yaml"), ["OUT_DIR", str(tmp_path)])
    path = config.dump_cfg(cfg)
    assert path == os.path.join(str(tmp_path), "config.yaml")
    again = load_cfg(path)
    assert again == cfg
    assert config.cfg_from_yaml_text(cfg.dump()) == cfg


def test_odd_override_list():
    with pytest.raises(ConfigError, match="KEY VALUE pairs"):
        load_cfg(None, ["TRAIN.IM_SIZE"])
