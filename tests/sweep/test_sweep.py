"""Sweeps: samplers, setup, launch (local submitit and a fake SLURM), collect and analyze."""

import json
import math
import os
import pickle
import random
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pycls import config
from pycls.checkpoint import run_lock
from pycls.config import ConfigError
from pycls.sweep import analyze, collect, setup
from pycls.sweep import submit as launch
from pycls.sweep.runs import list_runs
from pycls.sweep.samplers import Sampler, iter_points, sample_points
from pycls.sweep.sweep_file import load_sweep_cfg
from tests.helpers import ROOT, scaled

QUICKSTART_SWEEP = os.path.join(ROOT, "configs", "sweeps", "quickstart_lr.yaml")
VIT_B16_SWEEP = os.path.join(ROOT, "configs", "sweeps", "vit_b16_lr_wd.yaml")

# A model and schedule small enough that one run (process start included) takes a few seconds
TINY = {
    "OPTIM.MAX_EPOCH": 1,
    "OPTIM.WARMUP_EPOCHS": 0.0,
    "TRAIN.IM_SIZE": 16,
    "TEST.IM_SIZE": 16,
    "VIT.PATCH_SIZE": 4,
    "VIT.DEPTH": 1,
    "VIT.WIDTH": 32,
    "VIT.NUM_HEADS": 2,
    "VIT.MLP_DIM": 64,
    "TRAIN.BATCH_SIZE": 128,
    "TRAIN.EVAL_PERIOD": 1,
    "TRAIN.CHECKPOINT_PERIOD": 1,
    "TRAIN.AUGMENT": "none",
    "DATA_LOADER.NUM_WORKERS": 0,
}


def overrides_for(samplers, overrides=None):
    """TINY minus the swept keys, plus ``overrides``."""
    return {**{k: v for k, v in TINY.items() if k not in samplers}, **(overrides or {})}


def sweep_file(tmp_path, samplers, overrides=None, name="s", **top):
    """Writes a sweep file on the quickstart config; returns its path."""
    tree = {
        "NAME": name,
        "ROOT_DIR": str(tmp_path / "sweeps"),
        "SETUP": {
            "BASE_CFG": "configs/quickstart.yaml",
            "OVERRIDES": overrides_for(samplers, overrides),
            "SAMPLERS": samplers,
        },
        "LAUNCH": {"MODE": "local", "MAX_PARALLEL": 2, "TIME_LIMIT_MIN": 10},
    }
    for key, value in top.items():  # SETUP__NUM_CONFIGS=3 -> SETUP.NUM_CONFIGS
        group, _, sub = key.partition("__")
        (tree.setdefault(group, {}) if sub else tree)[sub or group] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def points_of(tmp_path, samplers, **top):
    return sample_points(load_sweep_cfg(sweep_file(tmp_path, samplers, **top)))


# ------------------------------------------------------------------------------------------------ #
# Samplers
# ------------------------------------------------------------------------------------------------ #


def test_grid_is_a_product_with_the_last_key_fastest(tmp_path):
    samplers = {
        "OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [1, 2]},  # ints become floats
        "VIT.CLASSIFIER": {"TYPE": "grid", "VALUES": ["token", "pooled"]},
        "VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2]},
    }
    points = points_of(tmp_path, samplers)
    assert len(points) == 8
    assert points[0] == {"OPTIM.BASE_LR": 1.0, "VIT.CLASSIFIER": "token", "VIT.DEPTH": 1}
    assert points[1] == {"OPTIM.BASE_LR": 1.0, "VIT.CLASSIFIER": "token", "VIT.DEPTH": 2}
    assert points[-1] == {"OPTIM.BASE_LR": 2.0, "VIT.CLASSIFIER": "pooled", "VIT.DEPTH": 2}
    assert len({tuple(p.values()) for p in points}) == 8
    assert isinstance(points[0]["OPTIM.BASE_LR"], float)


def test_random_log_uniform_in_range_and_reproducible(tmp_path):
    samplers = {
        "OPTIM.BASE_LR": {"TYPE": "float", "DIST": "log_uniform", "RANGE": ["1e-4", 1.0e-2]},
    }
    points = points_of(tmp_path, samplers, SETUP__NUM_CONFIGS=400, SETUP__SEED=3)
    lrs = [p["OPTIM.BASE_LR"] for p in points]
    assert len(lrs) == 400 and len(set(lrs)) == 400
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs)
    # Log-uniform: half the mass below the geometric mean 1e-3 (a uniform draw puts ~9 % there)
    below = sum(lr < 1e-3 for lr in lrs) / len(lrs)
    assert 0.42 < below < 0.58
    assert points_of(tmp_path, samplers, SETUP__NUM_CONFIGS=400, SETUP__SEED=3) == points
    assert points_of(tmp_path, samplers, SETUP__NUM_CONFIGS=400, SETUP__SEED=4) != points
    # More draws with the same seed keep the first points (a sweep can be extended)
    more = points_of(tmp_path, samplers, SETUP__NUM_CONFIGS=410, SETUP__SEED=3)
    assert more[:400] == points


def test_quantised_floats_and_ints_hit_every_multiple_evenly(tmp_path):
    wd = Sampler("OPTIM.WEIGHT_DECAY", {"TYPE": "float", "RANGE": [0.1, 0.5], "QUANTIZE": 0.05})
    depth = Sampler("VIT.DEPTH", {"TYPE": "int", "RANGE": [2, 12], "QUANTIZE": 2})
    rng = random.Random(0)
    wds = [wd.draw(rng) for _ in range(900)]
    depths = [depth.draw(rng) for _ in range(600)]
    grid = [round(0.1 + 0.05 * k, 2) for k in range(9)]
    assert set(wds) == set(grid)  # exact decimals, no 0.15000000000000002
    assert set(depths) == {2, 4, 6, 8, 10, 12} and all(isinstance(d, int) for d in depths)
    # End points get a full bucket, not half of one: each value about 1/9 (1/6) of the draws
    assert all(65 <= wds.count(v) <= 135 for v in grid), [wds.count(v) for v in grid]
    assert all(65 <= depths.count(v) <= 135 for v in set(depths))
    # The same through a sweep file, with a choice sampler alongside
    samplers = {
        "OPTIM.WEIGHT_DECAY": {"TYPE": "float", "RANGE": [0.1, 0.5], "QUANTIZE": 0.05},
        "VIT.DEPTH": {"TYPE": "int", "DIST": "log_uniform", "RANGE": [2, 12], "QUANTIZE": 2},
        "VIT.POS_EMBED": {"TYPE": "choice", "VALUES": ["learned", "sincos"]},
    }
    points = points_of(tmp_path, samplers, SETUP__NUM_CONFIGS=20)
    assert len({tuple(p.values()) for p in points}) == 20
    assert all(p["OPTIM.WEIGHT_DECAY"] in grid and p["VIT.DEPTH"] % 2 == 0 for p in points)
    assert {p["VIT.POS_EMBED"] for p in points} == {"learned", "sincos"}


def test_grid_crossed_with_random_draws(tmp_path):
    samplers = {
        "OPTIM.BASE_LR": {"TYPE": "float", "DIST": "log_uniform", "RANGE": [1.0e-4, 1.0e-2]},
        "VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2]},
    }
    points = points_of(tmp_path, samplers, SETUP__NUM_CONFIGS=3)
    assert [p["VIT.DEPTH"] for p in points] == [1, 2] * 3
    assert points[0]["OPTIM.BASE_LR"] == points[1]["OPTIM.BASE_LR"]
    assert len({p["OPTIM.BASE_LR"] for p in points}) == 3


LR = "OPTIM.BASE_LR"
BAD_SAMPLERS = [
    ({"OPTIM.BASE_LRX": {"TYPE": "grid", "VALUES": [1.0]}}, "SETUP.SAMPLERS.OPTIM.BASE_LRX:"),
    ({"OPTIM": {"TYPE": "grid", "VALUES": [1.0]}}, "SETUP.SAMPLERS.OPTIM: OPTIM is a group"),
    ({LR: {"TYPE": "gird", "VALUES": [1.0]}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.TYPE: 'gird'"),
    ({LR: {"TYPE": "grid", "VALUE": [1.0]}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.VALUE: not a field"),
    ({LR: {"TYPE": "grid", "VALUES": []}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.VALUES: needs a list"),
    ({LR: {"TYPE": "grid", "VALUES": [1, 1.0]}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.VALUES: repeats"),
    ({LR: {"TYPE": "grid", "VALUES": ["fast"]}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.VALUES: 'fast'"),
    ({LR: {"TYPE": "float", "RANGE": [1.0]}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.RANGE: needs two"),
    ({LR: {"TYPE": "float", "RANGE": [0.1, 0.01]}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.RANGE: LOW"),
    (
        {LR: {"TYPE": "float", "DIST": "log_uniform", "RANGE": [0.0, 0.1]}},
        "SETUP.SAMPLERS.OPTIM.BASE_LR.RANGE: log_uniform needs LOW > 0",
    ),
    ({LR: {"TYPE": "float", "DIST": "normal", "RANGE": [0, 1]}}, "OPTIM.BASE_LR.DIST: 'normal'"),
    (
        {LR: {"TYPE": "float", "RANGE": [0.1, 0.25], "QUANTIZE": 0.1}},
        "SETUP.SAMPLERS.OPTIM.BASE_LR.RANGE: 0.25 is not a multiple of QUANTIZE=0.1",
    ),
    ({"VIT.DEPTH": {"TYPE": "float", "RANGE": [1, 4]}}, "SETUP.SAMPLERS.VIT.DEPTH.TYPE: VIT.DEPT"),
    ({"VIT.DEPTH": {"TYPE": "int", "RANGE": [1, 4], "QUANTIZE": 0}}, "VIT.DEPTH.QUANTIZE"),
    ({LR: {"TYPE": "int", "RANGE": [1, 4]}}, "SETUP.SAMPLERS.OPTIM.BASE_LR.TYPE"),
    ({"OUT_DIR": {"TYPE": "grid", "VALUES": ["/x"]}}, "SETUP.SAMPLERS.OUT_DIR: OUT_DIR is set"),
    ({}, "SETUP.SAMPLERS: name at least one key"),
]


@pytest.mark.parametrize("samplers, message", BAD_SAMPLERS)
def test_bad_samplers_name_the_key(tmp_path, samplers, message):
    with pytest.raises(ConfigError) as e:
        points_of(tmp_path, samplers)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "top, message",
    [
        ({"SETUP__NUM_CONFIGS": 4}, "SETUP.NUM_CONFIGS: 4 random draws asked"),
        ({"NAME": ""}, "NAME: the sweep needs a name"),
        ({"NAME": "a/b"}, "NAME: 'a/b' may hold only"),
        ({"ROOT_DIR": ""}, "ROOT_DIR: set the folder"),
        ({"LAUNCH__MODE": "pbs"}, "LAUNCH.MODE: 'pbs' is not one of"),
        ({"LAUNCH__NODES": 2}, "LAUNCH.NODES: local runs"),
        ({"LAUNCH__FOO": 1}, "LAUNCH.FOO: unknown sweep key"),
        ({"LAUNCH__NODES": "two"}, "LAUNCH.NODES: takes a whole number, got text: 'two'"),
        ({"SETUP__BASE_CFG": "configs/nope.yaml"}, "SETUP.BASE_CFG: config file"),
    ],
)
def test_bad_sweep_keys_name_the_key(tmp_path, top, message):
    samplers = {"VIT.CLASSIFIER": {"TYPE": "grid", "VALUES": ["token", "pooled"]}}
    with pytest.raises(ConfigError) as e:
        points_of(tmp_path, samplers, **top)
    assert message in str(e.value)


def test_bad_overrides_and_random_needs_num_configs(tmp_path):
    grid = {"VIT.CLASSIFIER": {"TYPE": "grid", "VALUES": ["token", "pooled"]}}
    with pytest.raises(ConfigError, match=r"^SETUP\.OVERRIDES\.FOO\.BAR: 'FOO\.BAR' is not"):
        load_sweep_cfg(sweep_file(tmp_path, grid, overrides={"FOO.BAR": 1}))
    with pytest.raises(ConfigError, match=r"^SETUP\.OVERRIDES\.TRAIN\.AUTO_RESUME: .* set by"):
        load_sweep_cfg(sweep_file(tmp_path, grid, overrides={"TRAIN.AUTO_RESUME": False}))
    depth = {"VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2]}}
    with pytest.raises(ConfigError, match=r"^SETUP\.SAMPLERS\.VIT\.DEPTH: VIT\.DEPTH is also"):
        load_sweep_cfg(sweep_file(tmp_path, depth, overrides={"VIT.DEPTH": 1}))
    choice = {"VIT.CLASSIFIER": {"TYPE": "choice", "VALUES": ["token", "pooled"]}}
    with pytest.raises(ConfigError, match=r"^SETUP\.NUM_CONFIGS: must be > 0"):
        points_of(tmp_path, choice)
    with pytest.raises(ConfigError, match=r"^SETUP\.NUM_CONFIGS: only 2 distinct random points"):
        points_of(tmp_path, choice, SETUP__NUM_CONFIGS=3)


# A sweep file written by hand, with a key twice in one section somewhere: (text, key, lines)
_TWICE = {
    "SETUP.SAMPLERS": (
        "SETUP:\n  BASE_CFG: configs/quickstart.yaml\n"
        "  SAMPLERS:\n    OPTIM.BASE_LR: {TYPE: grid, VALUES: [0.001, 0.002]}\n"
        "  SAMPLERS:\n    VIT.DEPTH: {TYPE: grid, VALUES: [1]}\n",
        "SAMPLERS",
        "lines 5 and 7",
    ),
    "a sampler's field": (
        "SETUP:\n  BASE_CFG: configs/quickstart.yaml\n  SAMPLERS:\n    OPTIM.BASE_LR:\n"
        "      TYPE: grid\n      VALUES: [0.001]\n      VALUES: [0.001, 0.002]\n",
        "VALUES",
        "lines 8 and 9",
    ),
    "a swept key": (
        "SETUP:\n  BASE_CFG: configs/quickstart.yaml\n  SAMPLERS:\n"
        "    OPTIM.BASE_LR: {TYPE: grid, VALUES: [0.001]}\n"
        "    OPTIM.BASE_LR: {TYPE: grid, VALUES: [0.002, 0.003]}\n",
        "OPTIM.BASE_LR",
        "lines 6 and 7",
    ),
    "an override": (
        "SETUP:\n  BASE_CFG: configs/quickstart.yaml\n"
        "  OVERRIDES: {OPTIM.MAX_EPOCH: 1, OPTIM.MAX_EPOCH: 2}\n"
        "  SAMPLERS:\n    OPTIM.BASE_LR: {TYPE: grid, VALUES: [0.001]}\n",
        "OPTIM.MAX_EPOCH",
        "lines 5 and 5",
    ),
    "a top-level key": (
        "NAME: other\nSETUP:\n  BASE_CFG: configs/quickstart.yaml\n"
        "  SAMPLERS:\n    OPTIM.BASE_LR: {TYPE: grid, VALUES: [0.001]}\n",
        "NAME",
        "lines 1 and 3",
    ),
}


@pytest.mark.parametrize("where", list(_TWICE))
def test_a_key_written_twice_anywhere_in_a_sweep_file_is_refused_naming_it(tmp_path, capsys, where):
    """YAML keeps the last of two equal keys silently (one run instead of two): refused, as in
    run configs, naming the key and both lines, before anything is written."""
    text, key, lines = _TWICE[where]
    path = tmp_path / "twice.yaml"
    root = tmp_path / "sweeps"
    path.write_text(f"NAME: s\nROOT_DIR: {root}\n{text}")
    assert setup.main(["--sweep-cfg", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"key {key!r} appears twice" in line and lines in line
    assert str(path) in line and not root.exists()


@pytest.mark.parametrize("name", ["..", ".", "...", "../x", "/tmp/x", "a/../..", "x/y", ""])
@pytest.mark.parametrize("given", ["file", "command line"])
def test_a_name_that_is_not_one_folder_inside_the_root_is_refused(tmp_path, capsys, name, given):
    """NAME is the sweep's folder under ROOT_DIR: anything that is not one plain folder there
    (the root itself, its parent, an absolute path, a path) would write elsewhere."""
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [0.001]}}
    root = tmp_path / "a" / "sweeps"
    root.mkdir(parents=True)
    if given == "file":
        path, extra = sweep_file(tmp_path, samplers, ROOT_DIR=str(root)), []
        Path(path).write_text(Path(path).read_text().replace("NAME: s", f"NAME: {name!r}"))
    else:
        path = sweep_file(tmp_path, samplers, ROOT_DIR=str(root))
        extra = ["NAME", repr(name)]  # quoted: '...' and '' stay strings
    assert setup.main(["--sweep-cfg", path, *extra]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("sweep config error: NAME: "), line
    assert os.listdir(root) == [] and sorted(os.listdir(tmp_path / "a")) == ["sweeps"]


_NINE_KEYS = [
    "OPTIM.BASE_LR",
    "OPTIM.WEIGHT_DECAY",
    "OPTIM.MOMENTUM",
    "OPTIM.MIN_LR",
    "OPTIM.WARMUP_FACTOR",
    "TRAIN.LABEL_SMOOTHING",
    "VIT.DROP_PATH",
    "MIXUP.ALPHA",
    "MIXUP.CUTMIX_ALPHA",
]
_VALUES = [round(0.01 * (i + 1), 2) for i in range(20)]
_LR = {"TYPE": "float", "RANGE": [1e-4, 1e-2], "DIST": "log_uniform"}


@pytest.mark.parametrize(
    "samplers, top, count",
    [
        ({k: {"TYPE": "grid", "VALUES": _VALUES} for k in _NINE_KEYS}, {}, 20**9),
        (
            {"VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2]}, "OPTIM.BASE_LR": _LR},
            {"SETUP__NUM_CONFIGS": 10**12},
            2 * 10**12,
        ),
        ({"VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2, 3]}}, {"SETUP__MAX_POINTS": 2}, 3),
    ],
    ids=["grid 20^9", "random draws x grid", "a lowered limit"],
)
def test_too_many_points_are_counted_and_refused_before_any_is_made(tmp_path, samplers, top, count):
    """The points are counted when the file loads, from the samplers' sizes, and a sweep over
    SETUP.MAX_POINTS is refused naming the limit: nothing is materialised (20^9 points would
    be a MemoryError)."""
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^SETUP\.MAX_POINTS: the sweep has ") as e:
        load_sweep_cfg(sweep_file(tmp_path, samplers, **top))
    assert f"{count:,} points" in str(e.value) and time.perf_counter() - start < scaled(5)


def test_points_are_made_one_at_a_time(tmp_path):
    """With the limit raised, the first point of a 20^9 grid comes at once: nothing is built
    ahead; and a limit equal to the count is accepted."""
    samplers = {k: {"TYPE": "grid", "VALUES": _VALUES} for k in _NINE_KEYS}
    sc = load_sweep_cfg(sweep_file(tmp_path, samplers, SETUP__MAX_POINTS=20**9))
    start = time.perf_counter()
    first = next(iter_points(sc))
    assert first == {k: 0.01 for k in _NINE_KEYS} and time.perf_counter() - start < scaled(5)
    grid = {"VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2, 3]}}
    assert len(points_of(tmp_path, grid, SETUP__MAX_POINTS=3)) == 3


@pytest.mark.parametrize(
    "where, words",
    [
        (["LAUNCH.MODEE", "slurm"], "LAUNCH.MODEE: unknown sweep key (did you mean LAUNCH.MODE?)"),
        (
            ["SETUP.OVERRIDES.OPTIM.BASE_LRR", "0.1"],
            "'OPTIM.BASE_LRR' is not a pycls config key (did you mean OPTIM.BASE_LR?)",
        ),
        (["SETUP.NUM_CONFIG", "2"], "(did you mean SETUP.NUM_CONFIGS?)"),
    ],
)
def test_unknown_sweep_keys_name_the_closest_known_key(tmp_path, where, words):
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [0.001]}}
    with pytest.raises(ConfigError) as e:
        load_sweep_cfg(sweep_file(tmp_path, samplers), where)
    assert words in str(e.value)
    typo = {"OPTIM.WEIGHT_DECAYY": {"TYPE": "grid", "VALUES": [0.1]}}
    with pytest.raises(ConfigError, match=r"did you mean OPTIM\.WEIGHT_DECAY\?"):
        load_sweep_cfg(sweep_file(tmp_path, typo))


# ------------------------------------------------------------------------------------------------ #
# Setup
# ------------------------------------------------------------------------------------------------ #


def test_setup_writes_one_validated_config_per_point(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # BASE_CFG "configs/quickstart.yaml" is found in the repository
    samplers = {
        "OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [1.0e-3, 3.0e-3]},
        "VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2, 3]},
    }
    sc = load_sweep_cfg(sweep_file(tmp_path, samplers))
    setup.setup_sweep(sc)
    root = tmp_path / "sweeps" / "s"
    assert sorted(os.listdir(root / "cfgs")) == [f"000{i}.yaml" for i in range(6)]
    assert load_sweep_cfg(str(root / "sweep.yaml")) == sc
    cfgs = [config.load_cfg(str(root / "cfgs" / f"000{i}.yaml")) for i in range(6)]
    assert [(c.OPTIM.BASE_LR, c.VIT.DEPTH) for c in cfgs] == [
        (lr, d) for lr in (1e-3, 3e-3) for d in (1, 2, 3)
    ]
    assert [c.OUT_DIR for c in cfgs] == [str(root / "logs" / f"000{i}") for i in range(6)]
    assert all(c.TRAIN.AUTO_RESUME and c.OPTIM.MAX_EPOCH == 1 and c.VIT.WIDTH == 32 for c in cfgs)
    assert (
        (root / "cfgs" / "0004.yaml")
        .read_text()
        .startswith("# sweep s, point 0004: OPTIM.BASE_LR=0.003, VIT.DEPTH=2\n")
    )
    setup.setup_sweep(sc)  # setting up the same sweep again changes nothing


def test_setup_stops_at_an_impossible_point_naming_the_key(tmp_path):
    samplers = {"VIT.PATCH_SIZE": {"TYPE": "grid", "VALUES": [4, 8, 5]}}
    sc = load_sweep_cfg(sweep_file(tmp_path, samplers))
    with pytest.raises(ConfigError) as e:
        setup.setup_sweep(sc)
    msg = str(e.value)
    assert msg.startswith("TRAIN.IM_SIZE: 16 is not divisible by VIT.PATCH_SIZE=5")
    assert "(sweep point 0002: VIT.PATCH_SIZE=5)" in msg
    assert not (tmp_path / "sweeps" / "s" / "cfgs").exists()  # nothing written


def test_a_swept_vit_key_wins_over_the_arch_preset(tmp_path):
    samplers = {"VIT.DEPTH": {"TYPE": "grid", "VALUES": [1, 2]}}
    sc = load_sweep_cfg(sweep_file(tmp_path, samplers, overrides={"MODEL.ARCH": "vit_ti16"}))
    setup.setup_sweep(sc)
    cfgs = tmp_path / "sweeps" / "s" / "cfgs"
    depths = [config.load_cfg(str(cfgs / f"000{i}.yaml")).VIT.DEPTH for i in range(2)]
    assert depths == [1, 2]


def test_setup_appends_points_but_refuses_a_different_sweep(tmp_path):
    samplers = {"OPTIM.BASE_LR": {"TYPE": "float", "DIST": "log_uniform", "RANGE": [1e-4, 1e-2]}}
    setup.setup_sweep(load_sweep_cfg(sweep_file(tmp_path, samplers, SETUP__NUM_CONFIGS=2)))
    setup.setup_sweep(load_sweep_cfg(sweep_file(tmp_path, samplers, SETUP__NUM_CONFIGS=3)))
    assert len(os.listdir(tmp_path / "sweeps" / "s" / "cfgs")) == 3
    other = load_sweep_cfg(sweep_file(tmp_path, samplers, SETUP__NUM_CONFIGS=3, SETUP__SEED=9))
    with pytest.raises(RuntimeError, match="0000.yaml differs from this sweep's point 0000"):
        setup.setup_sweep(other)


def test_setup_command_line(tmp_path, capsys):
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [1.0e-3, 2.0e-3]}}
    path = sweep_file(tmp_path, samplers)
    argv = ["--sweep-cfg", path, "NAME", "cli", "SETUP.OVERRIDES.OPTIM.MAX_EPOCH", "3"]
    assert setup.main(argv) == 0
    assert "0001  OPTIM.BASE_LR=0.002" in capsys.readouterr().out
    cfg = config.load_cfg(str(tmp_path / "sweeps" / "cli" / "cfgs" / "0001.yaml"))
    assert cfg.OPTIM.MAX_EPOCH == 3 and cfg.OPTIM.BASE_LR == 2e-3
    assert setup.main(argv + ["SETUP.OVERRIDES.TRAIN.IM_SIZE", "30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sweep config error: TRAIN.IM_SIZE: 30 is not divisible")


def test_example_sweeps_load(tmp_path):
    sc = load_sweep_cfg(QUICKSTART_SWEEP, ["ROOT_DIR", str(tmp_path)])
    assert [p["OPTIM.BASE_LR"] for p in sample_points(sc)] == [1e-3, 4e-3]
    assert sc.LAUNCH.MODE == "local" and sc.SETUP.BASE_CFG.endswith("configs/quickstart.yaml")
    # The SLURM example: 16 distinct log-uniform points (its base config may be elsewhere)
    sc = load_sweep_cfg(VIT_B16_SWEEP, ["SETUP.BASE_CFG", "configs/quickstart.yaml"])
    points = sample_points(sc)
    assert len({tuple(p.values()) for p in points}) == 16
    assert all(1e-4 <= p["OPTIM.BASE_LR"] <= 3e-3 for p in points)
    assert all(1e-2 <= p["OPTIM.WEIGHT_DECAY"] <= 0.3 for p in points)
    assert launch.executor_parameters(sc) == {
        "name": "pycls_vit_b16_lr_wd",
        "timeout_min": 4320,
        "nodes": 1,
        "tasks_per_node": 8,
        "gpus_per_node": 8,
        "cpus_per_task": 10,
        "mem_gb": 480,
        "slurm_partition": "learnfair",
        "slurm_array_parallelism": 8,
    }
    assert launch.num_tasks(sc) == 8
    # Its 8 processes per run must train together
    sc = load_sweep_cfg(
        VIT_B16_SWEEP,
        [
            "SETUP.BASE_CFG",
            "configs/quickstart.yaml",
            "ROOT_DIR",
            str(tmp_path),
            "SETUP.OVERRIDES.TRAIN.PARALLEL",
            "none",
            "SETUP.OVERRIDES.DATA.PATH",
            "",  # the quickstart's digits read no folder
        ],
    )
    with pytest.raises(ConfigError, match=r"^TRAIN\.PARALLEL: 'none' would train 8 independent"):
        setup.setup_sweep(sc)


# ------------------------------------------------------------------------------------------------ #
# Collect and analyze what a kill, a full disk or an editor left behind
# ------------------------------------------------------------------------------------------------ #


def _stats_line(stats):
    return ("[trainer.py: 1]: json_stats: " + json.dumps(stats) + "\n").encode()


def _good_log(err):
    lines = [{"_type": "complexity", "flops": 5000, "params": 1000, "acts": 10}]
    lines += [{"_type": "train_epoch", "epoch_num": 1, "top1_err": 50.0, "time_epoch": 2.0}]
    lines += [{"_type": "test_epoch", "epoch_num": 1, "top1_err": err, "time_epoch": 1.0}]
    return b"".join(_stats_line(s) for s in lines)


# What each run's files hold: (its stdout.log, its config file replaced by, what is reported)
_DAMAGE = {
    "a byte that is not UTF-8": (
        _good_log(30.0).replace(b'"train_epoch"', b'"train_epoch", "note": "\xff"'),
        None,
        "line 2: bytes that are not UTF-8",
    ),
    "a torn UTF-8 sequence and a cut line": (
        _good_log(30.0) + b'[x]: json_stats: {"_type": "train_iter", "note": "\xc3',
        None,
        "line 4: not JSON",
    ),
    "a null epoch": (
        _good_log(30.0) + _stats_line({"_type": "test_epoch", "epoch_num": None, "top1_err": 1}),
        None,
        "a test_epoch line with epoch_num None",
    ),
    "an error that is text": (
        _good_log(30.0) + _stats_line({"_type": "test_epoch", "epoch_num": 1, "top1_err": "x"}),
        None,
        "a test_epoch line with top1_err 'x'",
    ),
    "a garbled config": (b"", b"OPTIM: [\xff", "left out"),
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_collect_reports_each_runs_bad_data_in_one_line_and_collects_the_rest(
    tmp_path, capsys, damage
):
    log, cfg_text, words = _DAMAGE[damage]
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [0.001, 0.002]}}
    path = sweep_file(tmp_path, samplers)
    sc = load_sweep_cfg(path)
    setup.setup_sweep(sc)
    good, bad = list_runs(sc)
    for run, text in ((good, _good_log(20.0)), (bad, log)):
        os.makedirs(run.out_dir)
        Path(run.log_file).write_bytes(text)
    if cfg_text is not None:
        Path(bad.cfg_file).write_bytes(cfg_text)
    jobs = tmp_path / "sweeps" / "s" / "launch" / "jobs.json"
    jobs.parent.mkdir()
    jobs.write_bytes(b'{"0000": {"stderr": "/x"}, ')  # cut short
    assert collect.main(["--sweep-cfg", path]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in "".join(lines), lines
    assert str(jobs) in lines[0]
    assert (bad.cfg_file if cfg_text else bad.log_file) in lines[1] and words in lines[1]
    runs = {
        r["name"]: r for r in json.loads((tmp_path / "sweeps" / "s" / "sweep.json").read_text())
    }
    assert runs["0000"]["status"] == "done" and runs["0000"]["final_top1_err"] == 20.0
    if cfg_text is None:  # the damaged log's good lines are collected
        assert runs["0001"]["status"] == "done" and runs["0001"]["final_top1_err"] == 30.0
        assert words in runs["0001"]["problems"]
    else:
        assert runs["0001"]["status"] == "unreadable" and runs["0001"]["error"]
    assert analyze.main(["--sweep-cfg", path]) == 0
    summary = (tmp_path / "sweeps" / "s" / "analysis" / "summary.md").read_text()
    assert "| 0000 | 0.001 | done | 20.00 |" in summary


_ENTRY = {
    "name": "0000",
    "status": "done",
    "swept": {"OPTIM.BASE_LR": 0.001},
    "final_top1_err": 20.0,
    "best_top1_err": 20.0,
    "train_time": 3.0,
    "complexity": {"flops": 5000, "params": 1000},
    "test_epoch": [{"epoch_num": 1, "top1_err": 20.0}],
}


@pytest.mark.parametrize(
    "bad, words",
    [
        ("not an object", "a JSON str, not an object"),
        ({**_ENTRY, "name": "0001", "final_top1_err": "20"}, "final_top1_err is '20'"),
        ({**_ENTRY, "name": "0001", "test_epoch": [{"epoch_num": None}]}, "numeric epoch_num"),
        ({**_ENTRY, "name": "0001", "swept": None}, "swept is None"),
        ({**_ENTRY, "name": "0001", "complexity": {"flops": "many"}}, "complexity flops"),
        ({"name": "0001"}, "status is None"),
    ],
)
def test_analyze_leaves_out_a_garbled_entry_naming_it_and_analyses_the_rest(
    tmp_path, capsys, bad, words
):
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [0.001, 0.002]}}
    path = sweep_file(tmp_path, samplers)
    root = tmp_path / "sweeps" / "s"
    root.mkdir(parents=True)
    (root / "sweep.json").write_text(json.dumps([_ENTRY, bad]))
    assert analyze.main(["--sweep-cfg", path]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"sweep: {root / 'sweep.json'}: entry 1 ") and words in line, line
    assert "| 0000 | 0.001 | done | 20.00 |" in (root / "analysis" / "summary.md").read_text()
    assert (root / "analysis" / "test_curves.png").stat().st_size > 0


@pytest.mark.parametrize("text", [b'[{"name": "0000", ', b"\xff\xfe[]", b'{"runs": []}', b""])
def test_analyze_refuses_a_sweep_json_that_is_not_a_list_in_one_line(tmp_path, capsys, text):
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [0.001, 0.002]}}
    path = sweep_file(tmp_path, samplers)
    root = tmp_path / "sweeps" / "s"
    root.mkdir(parents=True)
    (root / "sweep.json").write_bytes(text)
    assert analyze.main(["--sweep-cfg", path]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"sweep error: {root / 'sweep.json'} ") and "sweep_collect" in line


# ------------------------------------------------------------------------------------------------ #
# Launch on a fake SLURM: the sbatch script, the job array, and queued jobs left alone
# ------------------------------------------------------------------------------------------------ #


def _fake_slurm(bin_dir, state):
    """srun, sbatch (saves the script, answers job 4242) and sacct (every task in ``state``)."""
    bin_dir.mkdir()
    scripts = {
        "srun": "exit 0",
        "sbatch": f'cp "$1" {bin_dir}/script.sh; echo x >> {bin_dir}/calls\n'
        'echo "Submitted batch job 4242"',
        "sacct": 'echo "JobID|State|NodeList"; for i in $(seq 0 15); do '
        f'echo "4242_$i|{state}|node1"; done',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_launch_submits_one_array_and_skips_queued_jobs(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    _fake_slurm(bin_dir, "RUNNING")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    opts = ["SETUP.BASE_CFG", "configs/quickstart.yaml", "ROOT_DIR", str(tmp_path / "sweeps")]
    opts += ["LAUNCH.COMMENT", "sweep test", "SETUP.OVERRIDES.DATA.PATH", ""]  # digits: no folder
    sc = load_sweep_cfg(VIT_B16_SWEEP, opts)
    setup.setup_sweep(sc)
    result = launch.launch_sweep(sc)
    assert result["launched"] == [f"{i:04d}" for i in range(16)] and not result["failed"]
    script = (bin_dir / "script.sh").read_text()
    for line in (
        "#SBATCH --array=0-15%8",
        "#SBATCH --partition=learnfair",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=10",
        "#SBATCH --mem=480GB",
        "#SBATCH --time=4320",
        "#SBATCH --comment='sweep test'",
        "#SBATCH --signal=USR2@90",  # submitit checkpoints and requeues on this signal
    ):
        assert line in script
    jobs_json = tmp_path / "sweeps" / "vit_b16_lr_wd" / "launch" / "jobs.json"
    records = json.loads(jobs_json.read_text())
    assert records["0003"]["job_id"] == "4242_3" and records["0003"]["mode"] == "slurm"
    submitted = records["0003"]["stderr"].replace("_0_log.err", "_submitted.pkl")
    with open(submitted, "rb") as f:
        job = pickle.load(f).function
    assert isinstance(job, launch.TrainJob) and job.num_tasks == 8
    assert job.cfg_file.endswith("cfgs/0003.yaml")
    assert callable(job.checkpoint)  # what makes submitit requeue it on preemption
    # Launching again while the jobs run submits nothing
    result = launch.launch_sweep(sc)
    assert result["launched"] == [] and result["skipped"]["0005"] == "job 4242_5 is RUNNING"
    assert (bin_dir / "calls").read_text().count("x") == 1
    capsys.readouterr()


def _lock_held_by(folder, name, pid):
    os.makedirs(folder, exist_ok=True)
    info = {"host": socket.gethostname(), "pid": pid, "start_time": time.time()}
    (Path(folder) / name).write_text(json.dumps(info))


def test_second_launcher_is_refused_and_runs_locked_by_a_live_run_are_skipped(
    tmp_path, monkeypatch, capsys
):
    """Two sweep_launch.py on one sweep: the second is refused naming the first, and a run whose
    OUT_DIR a live process holds is reported as running, never launched a second time."""
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [0.001, 0.002]}}
    path = sweep_file(tmp_path, samplers)
    sc = load_sweep_cfg(path)
    setup.setup_sweep(sc)

    def no_launch(_):
        raise AssertionError("nothing may be launched here")

    monkeypatch.setattr(launch, "make_executor", no_launch)
    live = subprocess.Popen(["sleep", "60"])
    try:
        launcher = tmp_path / "sweeps" / "s" / "launch"
        _lock_held_by(launcher, launch.LAUNCHER_LOCK, live.pid)
        assert launch.main(["--sweep-cfg", path]) == 2  # a refusal, as every user mistake
        err = capsys.readouterr().err.strip()
        assert err.startswith("sweep error: sweep s is being launched by another sweep_launch.py")
        assert f"pid {live.pid}" in err and len(err.splitlines()) == 1
        os.remove(launcher / launch.LAUNCHER_LOCK)
        run0 = list_runs(sc)[0]
        _lock_held_by(run0.out_dir, run_lock.LOCK_FILE, live.pid)
        result = launch.launch_sweep(sc, dry_run=True)
        assert result["launched"] == ["0001"]
        assert result["skipped"]["0000"].startswith("running (its OUT_DIR is locked by host")
        # A job started on it anyway stops without writing sweep_error.txt into the healthy run
        with pytest.raises(run_lock.RunLockedError):
            launch.TrainJob(run0.cfg_file)()
        assert not os.path.exists(run0.error_file)
    finally:
        live.kill()
        live.wait()
    # Once its process is gone the lock is stale and the run is launched again
    assert launch.launch_sweep(sc, dry_run=True)["launched"] == ["0000", "0001"]
    capsys.readouterr()


# ------------------------------------------------------------------------------------------------ #
# End to end on this machine (submitit's LocalExecutor)
# ------------------------------------------------------------------------------------------------ #


def _tiny_opts(root):
    opts = ["ROOT_DIR", str(root), "LAUNCH.MAX_PARALLEL", "2"]
    for key, value in TINY.items():
        opts += [f"SETUP.OVERRIDES.{key}", str(value)]
    return opts


@pytest.mark.slow
def test_local_sweep_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    argv = ["--sweep-cfg", QUICKSTART_SWEEP] + _tiny_opts(tmp_path)
    root = tmp_path / "quickstart_lr"
    assert setup.main(argv) == 0
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "done   0000" in out and "done   0001" in out

    assert collect.main(argv) == 0
    runs = json.loads((root / "sweep.json").read_text())
    assert [r["name"] for r in runs] == ["0000", "0001"]
    assert [r["swept"] for r in runs] == [{"OPTIM.BASE_LR": 1e-3}, {"OPTIM.BASE_LR": 4e-3}]
    for r in runs:
        assert r["status"] == "done" and r["error"] is None
        assert math.isfinite(r["final_top1_err"]) and math.isfinite(r["best_top1_err"])
        assert 0 <= r["best_top1_err"] <= r["final_top1_err"] <= 100
        assert r["complexity"]["params"] > 0 and r["complexity"]["flops"] > 0
        assert r["train_time"] > 0 and r["epochs_done"] == 1
        assert [s["epoch_num"] for s in r["train_epoch"]] == [1]
        assert r["cfg"]["OPTIM"]["BASE_LR"] == r["swept"]["OPTIM.BASE_LR"]
        assert os.path.isfile(r["stderr"])

    assert analyze.main(argv) == 0
    files = ["summary.md", "error_vs_optim_base_lr.png"]
    files += ["error_vs_train_time.png", "test_curves.png"]
    for name in files:
        assert (root / "analysis" / name).stat().st_size > 0, name
    assert not (root / "analysis" / "error_vs_flops.png").exists()  # one model size: no plot
    summary = (root / "analysis" / "summary.md").read_text()
    assert "| run | OPTIM.BASE_LR | status | final top-1 err |" in summary
    assert "| 0001 | 0.004 | done |" in summary

    # Launching again skips both finished runs and starts nothing
    capsys.readouterr()
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "skip   0000: finished" in out and "skip   0001: finished" in out
    assert "started" not in out


@pytest.mark.slow
def test_failed_run_is_reported_and_the_other_finishes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    # a run that fails as it starts (a folder that is not there) beside one that needs none
    samplers = {"TRAIN.DATASET": {"TYPE": "grid", "VALUES": ["synthetic", "imagefolder"]}}
    missing = str(tmp_path / "no_such_data")
    sc = load_sweep_cfg(sweep_file(tmp_path, samplers, overrides={"DATA.PATH": missing}))
    setup.setup_sweep(sc)
    result = launch.launch_sweep(sc)
    out = capsys.readouterr().out
    log = tmp_path / "sweeps" / "s" / "logs" / "0001" / "stdout.log"
    assert list(result["failed"]) == ["0001"] and "no_such_data" in result["failed"]["0001"]
    assert f"FAILED 0001: {result['failed']['0001']}" in out
    assert f"log:    {log}" in out and "stderr: " in out and "_log.err" in out
    assert "done   0000" in out

    runs = {r["name"]: r for r in collect.collect_sweep(sc)}
    assert runs["0000"]["status"] == "done" and math.isfinite(runs["0000"]["final_top1_err"])
    assert runs["0001"]["status"] == "failed" and runs["0001"]["final_top1_err"] is None
    assert "no_such_data" in runs["0001"]["error"] and runs["0001"]["log_file"] == str(log)
    analyze.analyze_sweep(sc)
    summary = (tmp_path / "sweeps" / "s" / "analysis" / "summary.md").read_text()
    assert "| 0001 | imagefolder | failed | - | - |" in summary
    assert "run 0001 failed" in summary


def _child_pids(pid):
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            out.append(int(entry))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's process in /proc")
def test_preempted_job_is_requeued_and_resumes(tmp_path, monkeypatch):
    """SLURM's warning signal (USR2) reaches a training task: submitit calls the job's checkpoint
    method and requeues it, and the requeued job resumes the run from its last checkpoint."""
    import submitit

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    samplers = {"OPTIM.BASE_LR": {"TYPE": "grid", "VALUES": [1.0e-3]}}
    overrides = {"OPTIM.MAX_EPOCH": 3, "TRAIN.EVAL_PERIOD": 3}
    sc = load_sweep_cfg(sweep_file(tmp_path, samplers, overrides=overrides))
    setup.setup_sweep(sc)
    (run,) = list_runs(sc)
    launch._export_repo_path()
    executor = submitit.AutoExecutor(folder=str(tmp_path / "submitit"), cluster="local")
    executor.update_parameters(timeout_min=5, gpus_per_node=0)
    job = executor.submit(launch.TrainJob(run.cfg_file))
    try:
        first = os.path.join(run.out_dir, "checkpoints", "model_epoch_0001.pyth")
        deadline = time.time() + scaled(120)
        while not os.path.exists(first) and time.time() < deadline and not job.done():
            time.sleep(0.05)
        (task,) = _child_pids(job._process.pid)  # the local controller runs one task
        os.kill(task, signal.SIGUSR2)
        job.result()
    finally:
        if not job.done():
            job.cancel()
    with open(run.log_file) as f:
        text = f.read()
    assert "resumed from" in text, text[-2000:]
    assert "Caught signal SIGUSR2" in job.stderr()
    assert launch.is_finished(run)
