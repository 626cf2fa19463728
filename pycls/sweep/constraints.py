"""SETUP.CONSTRAINTS: which resolved run configs a sweep keeps (schema in
pycls/sweep/sweep_file.py).

A random point whose run config breaks a constraint is drawn again, as upstream pycls's sweep
setup does: the RegNet stage count is checked on REGNET.{WA,W0,WM,DEPTH} alone, the complexity on
the model the builders make (an analytic count on the meta device: nothing is allocated).
"""

import math

from pycls.core.scale_config import complexity
from pycls.errors import require

CX_KEYS = ("FLOPS", "PARAMS", "ACTS")


def check_constraints(sc):
    """Checks the shape of SETUP.CONSTRAINTS; raises ConfigError naming the key."""
    ranges = [(f"CX.{k}", sc.SETUP.CONSTRAINTS.CX[k]) for k in CX_KEYS]
    ranges.append(("REGNET.NUM_STAGES", sc.SETUP.CONSTRAINTS.REGNET.NUM_STAGES))
    for key, rng in ranges:
        where = f"SETUP.CONSTRAINTS.{key}"
        require(
            len(rng) == 2 and all(isinstance(v, (int, float)) and v >= 0 for v in rng),
            where,
            f"needs [LOW, HIGH] of numbers >= 0 (0 = open end), got {list(rng)}",
        )
        require(rng[1] == 0 or rng[0] <= rng[1], where, f"LOW {rng[0]} exceeds HIGH {rng[1]}")


def regnet_stages(wa, w0, wm, depth, q=8):
    """(stages the widths form, stages the rule allows): upstream's generate_regnet counts."""
    ks = [round(math.log((i * wa + w0) / w0) / math.log(wm)) for i in range(depth)]
    widths = {round(w0 * math.pow(wm, k) / q) * q for k in ks}
    return len(widths), max(ks) + 1


def _within(value, rng):
    low, high = rng
    return (low == 0 or value >= low) and (high == 0 or value <= high)


def violation(sc, cfg):
    """None when the run config ``cfg`` meets SETUP.CONSTRAINTS, else what it breaks."""
    cons = sc.SETUP.CONSTRAINTS
    stages = cons.REGNET.NUM_STAGES
    if cfg.MODEL.TYPE == "regnet" and list(stages) != [0, 0]:
        r = cfg.REGNET
        num, allowed = regnet_stages(r.WA, r.W0, r.WM, r.DEPTH)
        if num != allowed or not _within(num, stages):
            return f"REGNET.NUM_STAGES: {num} stages of {allowed} possible, not in {list(stages)}"
    wanted = [k for k in CX_KEYS if list(cons.CX[k]) != [0, 0]]
    if wanted:
        cx = complexity(cfg)
        for key in wanted:
            if not _within(cx[key.lower()], cons.CX[key]):
                return f"CX.{key}: {cx[key.lower()]} not in {list(cons.CX[key])}"
    return None
