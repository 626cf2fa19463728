"""--mode scale gives upstream pycls's scaled models ("Fast and Accurate Model Scaling").

tests/data/upstream_scaling.json holds what upstream's own code (models/scaler.py at
facebookresearch/pycls 5719de6) made of some of its configs (tests/data/upstream_configs.json):
the scaled keys and the complexity before and after. The key arithmetic is checked on a tree of
upstream's keys; the complexity needs the CNN families of pycls.models.
"""

import json
import os
import sys

import pytest
import yaml
from yacs.config import CfgNode

from pycls import config
from pycls.config import upstream_keys as upstream
from pycls.core import scale_config as model_scaling
from pycls.errors import ConfigError
from pycls.models.cnn import model_scaling as scaling
from tests.helpers import ROOT, RUN_NET, scaled
from tests.helpers.warm import run as warm_run

with open(os.path.join(ROOT, "tests", "data", "upstream_scaling.json")) as f:
    CASES = json.load(f)["cases"]
with open(os.path.join(ROOT, "tests", "data", "upstream_configs.json")) as f:
    CONFIGS = json.load(f)["files"]

HAS_FAMILIES = config.get_default_cfg().get("REGNET") is not None
FAMILY_SKIP = "the CNN families (pycls.models regnet, anynet, effnet) are not in this tree yet"
IDS = [f"{os.path.basename(c['config'])}-{c['SCALING_TYPE']}x{c['SCALING_FACTOR']}" for c in CASES]


def upstream_tree(path):
    """Upstream's config tree (its defaults, then the file), as upstream's scaler saw it."""
    tree = {}
    for key, value in upstream.UPSTREAM_DEFAULTS.items():
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    c = CfgNode(tree)
    c.merge_from_other_cfg(CfgNode(yaml.safe_load(CONFIGS[path]["text"])))
    return c


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_scaled_keys_are_upstreams(case):
    c = upstream_tree(case["config"])
    c.MODEL.SCALING_TYPE, c.MODEL.SCALING_FACTOR = case["SCALING_TYPE"], case["SCALING_FACTOR"]
    model_scaling.scale_keys(c)
    for key, want in case["scaled_keys"].items():
        got = config.get(c, key)
        assert (list(got) if isinstance(got, (list, tuple)) else got) == want, key


def test_scaling_factors_multiply_flops_by_the_factor():
    for scale_type in ("d1_w8_g8_r1", "dw", "d", "w", "r", "d1_w2", "dwr"):
        d, w, g, r = scaling.scaling_factors(scale_type, 4.0)
        assert d * w * w * r * r == pytest.approx(4.0)
    # group width alone (no FLOPs of its own to count) is scaled by the factor itself
    assert scaling.scaling_factors("g", 4.0) == (1.0, 1.0, 4.0, 1.0)
    with pytest.raises(ValueError, match="'x2' is not d, w, g or r"):
        scaling.scaling_factors("d1_x2", 2.0)


def test_depth_scaling_of_resnet56_gives_resnet110():
    """Doubling the depth of upstream's CIFAR ResNet-56 (AnyNet) gives its ResNet-110: the stage
    depths, and (in the reference) upstream's published complexity of R-110."""
    case = next(c for c in CASES if c["config"].endswith("R-56_nds_1gpu.yaml"))
    assert case["scaled_keys"]["ANYNET.DEPTHS"] == [18, 18, 18]
    r110 = CONFIGS["configs/archive/cifar/anynet/R-110_nds_1gpu.yaml"]["complexity"]
    assert case["complexity_after"] == r110


@pytest.mark.skipif(not HAS_FAMILIES, reason=FAMILY_SKIP)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_scale_mode_gives_upstreams_complexity(tmp_path, case):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIGS[case["config"]]["text"])
    out_dir, name = tmp_path / "out", "scaled.yaml"
    args = ["MODEL.SCALING_TYPE", case["SCALING_TYPE"], "MODEL.SCALING_FACTOR"]
    args += [str(case["SCALING_FACTOR"]), "OUT_DIR", str(out_dir), "CFG_DEST", name]
    cmd = [sys.executable, RUN_NET, "--mode", "scale", "--cfg", str(path), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = warm_run(cmd, env=env, timeout=scaled(300))
    assert out.returncode == 0, out.stderr[-3000:]
    stats = [
        json.loads(x.split("json_stats: ", 1)[1]) for x in out.stdout.splitlines() if "json_" in x
    ]
    before, after = (s for s in stats if s["_type"] == "complexity")
    for got, want in ((before, case["complexity_before"]), (after, case["complexity_after"])):
        assert {k: got[k] for k in ("flops", "params", "acts")} == want
    written = config.load_cfg(str(out_dir / name))  # the written config is ours and loads
    assert case["scaled_keys"]["MODEL.TYPE"] == written.MODEL.TYPE


def test_scale_refuses_a_vit(tmp_path):
    c = config.load_cfg(os.path.join(ROOT, "configs", "quickstart.yaml"))
    with pytest.raises(ConfigError, match="MODEL.TYPE: --mode scale scales"):
        model_scaling.scale_cfg(c)
