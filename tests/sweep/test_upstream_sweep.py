"""Upstream pycls's sweep files (its configs/sweeps/cifar/*.yaml, byte for byte from
tests/data/upstream_configs.json) through our sweep tools: translation, upstream's sampling rules,
the constraints, and run_net's refusal."""

import json
import logging
import math
import os
import random
import sys
from decimal import Decimal

import pytest
import yaml

from pycls import config
from pycls.config import ConfigError
from pycls.core.scale_config import complexity
from pycls.sweep import draws, setup
from pycls.sweep.constraints import regnet_stages, violation
from pycls.sweep.samplers import Sampler
from pycls.sweep.sweep_file import load_sweep_cfg
from tests.helpers import ROOT
from tests.helpers.warm import run as warm_run

with open(os.path.join(ROOT, "tests", "data", "upstream_configs.json")) as _f:
    UPSTREAM_FILES = json.load(_f)["files"]
# Upstream's files give BN no weight decay and biases OPTIM.WEIGHT_DECAY; here norms and biases
# share one group, so the biases' decay is set to BN's on the command line (the file unchanged)
BIAS_AS_BN = ["SETUP.BASE_CFG.OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY", "True"]


def path_of(name, folder):
    """Upstream's sweep file ``name``, written unchanged into ``folder``."""
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(UPSTREAM_FILES[f"configs/sweeps/cifar/{name}.yaml"]["text"])
    return path


def load(name, tmp_path, num, *extra):
    opts = ["ROOT_DIR", str(tmp_path), "SETUP.NUM_CONFIGS", str(num), *BIAS_AS_BN, *extra]
    return load_sweep_cfg(path_of(name, tmp_path), opts)


def upstream_tree(name):
    return yaml.safe_load(UPSTREAM_FILES[f"configs/sweeps/cifar/{name}.yaml"]["text"])


def run_cfgs(sc, runs):
    """Each written cfgs/NNNN.yaml loaded back as run_net loads it."""
    folder = os.path.join(sc.ROOT_DIR, sc.NAME, "cfgs")
    assert sorted(os.listdir(folder)) == [f"{name}.yaml" for name, _, _ in runs]
    return [config.load_cfg(os.path.join(folder, f"{name}.yaml")) for name, _, _ in runs]


def check_base(cfg, tree):
    """The inline BASE_CFG's keys, as the config translation reads them."""
    base = tree["SETUP"]["BASE_CFG"]
    assert base["MODEL"]["TYPE"] == cfg.MODEL.TYPE and cfg.MODEL.NUM_CLASSES == 10
    assert cfg.TRAIN.BATCH_SIZE == 1024 and cfg.TEST.BATCH_SIZE == 1000
    assert cfg.TRAIN.IM_SIZE == 32 and cfg.OPTIM.NESTEROV and cfg.OPTIM.LR_POLICY == "cos"
    assert cfg.MIXUP.ALPHA == 0.5 and cfg.TRAIN.LABEL_SMOOTHING == 0.1
    assert cfg.TRAIN.EMA and cfg.TRAIN.EMA_PERIOD == 32
    assert cfg.OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP == 0.0
    assert cfg.TRAIN.DATASET == cfg.TEST.DATASET == "cifar10"


def is_multiple(x, q):
    return Decimal(str(x)) % Decimal(str(q)) == 0


def test_unchanged_file_names_the_bias_decay_it_cannot_honour(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_sweep_cfg(path_of("cifar_optim", tmp_path), ["ROOT_DIR", str(tmp_path)])
    msg = str(e.value)
    assert msg.startswith("SETUP.BASE_CFG.BN.USE_CUSTOM_WEIGHT_DECAY: norms and biases share")
    assert "SETUP.BASE_CFG.<KEY> VALUE" in msg


def test_cifar_optim_sets_up_upstream_quantised_lr_and_wd(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    sc = load("cifar_optim", tmp_path, 4)
    said = caplog.text
    for key in ("NAME", "SETUP.SAMPLERS.OPTIM.BASE_LR.TYPE", "SETUP.BASE_CFG", "LAUNCH.PARTITION"):
        assert f"{key}: upstream pycls's sweep key" in said
    assert "TRAIN.MIXUP_ALPHA: upstream pycls's key (0.5) read as MIXUP.ALPHA 0.5" in said
    assert sc.NAME == "cifar.cifar_optim" and sc.SETUP.BASE_CFG == ""
    assert sc.LAUNCH.MODE == "slurm" and sc.LAUNCH.PARTITION == "devlab"
    assert (sc.LAUNCH.GPUS_PER_NODE, sc.LAUNCH.MAX_PARALLEL, sc.LAUNCH.TIME_LIMIT_MIN) == (
        1,
        32,
        60,
    )
    assert sc.SETUP.SAMPLERS["OPTIM.BASE_LR"].QUANTIZE_RULE == "upstream"
    runs = setup.setup_sweep(sc)
    tree = upstream_tree("cifar_optim")
    for (_, point, _), cfg in zip(runs, run_cfgs(sc, runs)):
        check_base(cfg, tree)
        assert cfg.ANYNET.DEPTHS == [9, 9, 9] and cfg.ANYNET.WIDTHS == [16, 32, 64]
        assert 0.25 <= cfg.OPTIM.BASE_LR <= 5.0 and 5e-5 <= cfg.OPTIM.WEIGHT_DECAY <= 1e-3
        assert cfg.OPTIM.BASE_LR == point["OPTIM.BASE_LR"] != 1.0
        assert is_multiple(cfg.OPTIM.BASE_LR, 1e-10) and is_multiple(cfg.OPTIM.WEIGHT_DECAY, 1e-10)


def test_cifar_best_sets_up_values_and_seeds(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    sc = load("cifar_best", tmp_path, 6)
    assert "SETUP.SAMPLERS.RNG_SEED.TYPE: upstream pycls's sweep key ('int_sampler')" in caplog.text
    runs = setup.setup_sweep(sc)
    tree = upstream_tree("cifar_best")
    points = set()
    for cfg in run_cfgs(sc, runs):
        check_base(cfg, tree)
        r = cfg.REGNET
        assert (r.DEPTH, r.W0, r.WA, r.WM, r.GROUP_W, r.SE_ON) == (12, 96, 19.5, 2.942, 8, True)
        assert regnet_stages(r.WA, r.W0, r.WM, r.DEPTH) == (2, 2)
        assert cfg.OPTIM.MAX_EPOCH in (50, 100, 200, 400) and cfg.RNG_SEED in (1, 2, 3)
        points.add((cfg.OPTIM.MAX_EPOCH, cfg.RNG_SEED))
    assert len(points) == 6


def test_cifar_regnet_sets_up_configs_within_the_constraints(tmp_path):
    sc = load("cifar_regnet", tmp_path, 2)
    assert sc.SETUP.MAX_DRAWS == 1000000  # upstream's NUM_SAMPLES default
    runs = setup.setup_sweep(sc)
    for (_, point, _), cfg in zip(runs, run_cfgs(sc, runs)):
        check_base(cfg, upstream_tree("cifar_regnet"))
        r = cfg.REGNET
        assert 6 <= r.DEPTH <= 16 and r.STEM_TYPE == "res_stem_cifar" and r.SE_ON
        assert r.GROUP_W in (1, 2, 4) or r.GROUP_W in (8, 16, 24, 32)
        assert regnet_stages(r.WA, r.W0, r.WM, r.DEPTH) == (2, 2)
        cx = complexity(cfg)  # the builders' count, independently of the setup's check
        assert 0.12e9 <= cx["flops"] <= 0.13e9 and cx["params"] <= 2e6 and cx["acts"] <= 1e6
        assert point["REGNET.DEPTH"] == r.DEPTH and point["REGNET.WA"] == r.WA


def test_constraint_violating_configs_are_named(tmp_path):
    sc = load("cifar_regnet", tmp_path, 2)
    best = ["REGNET.DEPTH", 12, "REGNET.W0", 96, "REGNET.WA", 19.5, "REGNET.WM", 2.942]
    best += ["REGNET.GROUP_W", 8]
    overrides = [x for k, v in sc.SETUP.OVERRIDES.items() for x in (k, v)]
    cfg = config.load_cfg(None, overrides + best)
    assert violation(sc, cfg) is None  # upstream's best RegNet-125MF of this sweep (120.5 MF)
    wider = config.load_cfg(None, overrides + best[:2] + ["REGNET.W0", 128] + best[4:])
    assert violation(sc, wider).startswith("CX.FLOPS: ")
    three = config.load_cfg(None, overrides + best[:4] + ["REGNET.WA", 60.0] + best[6:])
    assert regnet_stages(60.0, 96, 2.942, 12)[0] == 3
    assert violation(sc, three).startswith("REGNET.NUM_STAGES: 3 stages")


def test_setup_draws_again_until_the_constraints_hold(tmp_path):
    sc = load("cifar_regnet", tmp_path, 1, "SETUP.MAX_DRAWS", "40")
    with pytest.raises(ConfigError, match=r"refused by SETUP.CONSTRAINTS"):
        setup.build_run_cfgs(sc)  # 40 draws hold no 125 MF two-stage RegNet (seed 0)


def frequencies(values):
    out = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return {k: n / len(values) for k, n in out.items()}


def test_regnet_sampler_follows_upstream_rules():
    sampler = Sampler("REGNET", {"TYPE": "regnet", "DEPTH": [6, 16], "GROUP_W": [1, 32]})
    assert sampler.keys == [
        f"REGNET.{k}" for k in ("DEPTH", "W0", "WA", "WM", "GROUP_W", "BOT_MUL")
    ]
    rng, n = random.Random(0), 6000
    drawn = [sampler.draw_items(rng) for _ in range(n)]
    col = {k: [d[k] for d in drawn] for k in sampler.keys}
    for key, (kind, _, _, _) in draws.REGNET_RULES.items():
        low, high = sampler.ranges[key]
        assert all(type(v) is kind and low <= v <= high for v in col[f"REGNET.{key}"]), key
    assert all(is_multiple(v, 8) for v in col["REGNET.W0"])
    assert all(is_multiple(v, "0.1") for v in col["REGNET.WA"])
    assert all(is_multiple(v, "0.001") for v in col["REGNET.WM"])
    assert set(col["REGNET.BOT_MUL"]) == {1.0}
    # DEPTH: uniform over the 11 integers
    depth = frequencies(col["REGNET.DEPTH"])
    assert set(depth) == set(range(6, 17)) and all(abs(p - 1 / 11) < 0.02 for p in depth.values())
    # GROUP_W: a power of 2 in {1, ..., 32}; those >= 8 (half) redrawn log-uniform in [8, 32]
    gw = frequencies(col["REGNET.GROUP_W"])
    assert set(gw) == {1, 2, 4, 8, 16, 24, 32}
    assert all(abs(gw[k] - 1 / 6) < 0.02 for k in (1, 2, 4))
    assert abs(gw[8] - 0.5 * math.log(8 / 4) / math.log(32 / 4)) < 0.02  # rounded up from (4, 8]
    # W0: log-uniform in (4, 256], rounded up to a multiple of 8: P(8) = log(2) / log(64) = 1/6
    # (the centred rule would give log(12 / 4) / log(260 / 4) = 0.26)
    assert abs(frequencies(col["REGNET.W0"])[8] - 1 / 6) < 0.02


@pytest.mark.parametrize(
    "dist, low, high, q, value, expected",
    [
        ("uniform", 1, 3, 1, 1, 1 / 3),  # [1, 4) rounded down
        ("uniform", 0.5, 2.0, 0.5, 2.0, 1 / 4),
        ("log_uniform", 1.0, 4.0, 1.0, 1.0, math.log(2) / math.log(8)),  # (0.5, 4] rounded up
        ("log_uniform", 2, 16, 2, 16, math.log(16 / 14) / math.log(16)),  # (1, 16]
    ],
)
def test_upstream_quantisation(dist, low, high, q, value, expected):
    kind = "int" if isinstance(q, int) else "float"
    spec = {"TYPE": kind, "RANGE": [low, high], "DIST": dist, "QUANTIZE": q}
    sampler = Sampler("RNG_SEED" if kind == "int" else "OPTIM.BASE_LR", spec)
    upstream = Sampler(sampler.key, {**spec, "QUANTIZE_RULE": "upstream"})
    rng = random.Random(1)
    values = [upstream.draw(rng) for _ in range(8000)]
    assert all(low <= v <= high and is_multiple(v, q) for v in values)
    assert abs(frequencies(values)[value] - expected) < 0.02
    if (dist, low, q) == (
        "log_uniform",
        1.0,
        1.0,
    ):  # our centred rule differs measurably: log(3) / log(9) = 0.5
        ours = [sampler.draw(rng) for _ in range(8000)]
        assert abs(frequencies(ours)[value] - expected) > 0.03


def write(tmp_path, tree):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


@pytest.mark.parametrize(
    "change, key",
    [
        (("SAMPLERS", {"OPTIM.BASE_LR": {"TYPE": "list_sampler"}}), "SETUP.SAMPLERS.OPTIM.BASE_LR"),
        (
            ("SAMPLERS", {"OPTIM.BASE_LR": {"TYPE": "float_sampler", "RAND_TYPE": "normal"}}),
            "SETUP.SAMPLERS.OPTIM.BASE_LR.RAND_TYPE: 'normal' is not drawn here",
        ),
        (("LAUNCH", {"MODE": "time"}), "LAUNCH.MODE: 'time'"),
    ],
)
def test_what_cannot_be_honoured_is_named(tmp_path, change, key):
    tree = upstream_tree("cifar_optim")
    where, value = change
    if where == "LAUNCH":
        tree["LAUNCH"].update(value)
    else:
        tree["SETUP"]["SAMPLERS"] = value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_sweep_cfg(write(tmp_path, tree), ["ROOT_DIR", str(tmp_path), *BIAS_AS_BN])


def test_base_cfg_overrides_need_an_inline_base(tmp_path):
    path = os.path.join(ROOT, "configs", "sweeps", "quickstart_lr.yaml")
    with pytest.raises(ConfigError, match=r"SETUP\.OVERRIDES\.OPTIM"):
        load_sweep_cfg(path, ["ROOT_DIR", str(tmp_path), *BIAS_AS_BN])


def test_run_net_names_the_sweep_tool(tmp_path):
    path = path_of("cifar_regnet", tmp_path)
    cmd = [sys.executable, os.path.join(ROOT, "tools", "run_net.py"), "--mode", "info"]
    out = warm_run(cmd + ["--cfg", path])
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown config key" not in lines[0]
    assert f"{path} is a sweep file" in lines[0]
    assert f"pycls sweep-setup --sweep-cfg {path}" in lines[0]


@pytest.mark.parametrize(
    "key, spec, message",
    [
        ("REGNET", {"W0": [10, 256]}, r"REGNET\.W0: \[10, 256\]: both ends must be multiples of 8"),
        ("REGNET", {"GROUP_W": [3, 32]}, r"REGNET\.GROUP_W: \[3, 32\]: both ends must be powers"),
        ("REGNET", {"WA": [8.0]}, r"REGNET\.WA: needs two numbers"),
        ("REGNET", {"DEPTH": [6.5, 16]}, r"REGNET\.DEPTH: needs ints"),
        ("REGNET", {"STEM_W": [8, 16]}, r"REGNET\.STEM_W: not a field of a regnet sampler"),
        ("OPTIM.BASE_LR", {}, r"OPTIM\.BASE_LR: TYPE regnet is the sampler of key REGNET"),
    ],
)
def test_bad_regnet_sampler_is_named(key, spec, message):
    with pytest.raises(ConfigError, match=message):
        Sampler(key, {"TYPE": "regnet", **spec})
