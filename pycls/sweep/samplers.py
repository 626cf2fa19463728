"""Samplers: the values a swept key takes, and the points of a sweep.

Each entry of ``SETUP.SAMPLERS`` maps a dotted pycls key to one sampler:

=========  ==============================================  =====================================
TYPE       fields                                          values
=========  ==============================================  =====================================
grid       VALUES: [v1, v2, ...]                           every value (grids form a product)
choice     VALUES: [v1, v2, ...]                           one per random draw, uniformly
float      RANGE: [LOW, HIGH], DIST, QUANTIZE (0 = none)   a float in [LOW, HIGH]
int        RANGE: [LOW, HIGH], DIST, QUANTIZE (default 1)  an int in [LOW, HIGH]
=========  ==============================================  =====================================

``DIST`` is ``uniform`` (default) or ``log_uniform`` (LOW > 0; uniform in log space, the usual
choice for learning rates and weight decay). With ``QUANTIZE`` q > 0 values are multiples of q,
LOW and HIGH must be multiples of q, and every multiple in the range gets the probability mass of
the interval within q/2 of it (so the end points are not under-sampled). Unquantised floats are
kept to 6 significant digits, the precision of the json_stats logs.

The points: random draws are the outer loop (``SETUP.NUM_CONFIGS`` distinct draws from a
``random.Random(SETUP.SEED)``), the grid product the inner one, in the order the keys are written
with the last key varying fastest.
"""

import itertools
import math
import random

from yacs.config import CfgNode

from pycls.core.config import ConfigError
from pycls.core.config import require as _require
from pycls.sweep.keys import check_pycls_key, coerce_value

GRID_TYPES = ("grid",)
RANDOM_TYPES = ("choice", "float", "int")
DISTS = ("uniform", "log_uniform")
_FIELDS = {
    "grid": {"TYPE", "VALUES"},
    "choice": {"TYPE", "VALUES"},
    "float": {"TYPE", "RANGE", "DIST", "QUANTIZE"},
    "int": {"TYPE", "RANGE", "DIST", "QUANTIZE"},
}
_MAX_DRAWS_PER_POINT = 100


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_multiple(x, q):
    k = round(x / q)
    return math.isclose(k * q, x, rel_tol=1e-9, abs_tol=1e-12)


class Sampler:
    """One validated sampler of pycls key ``key``; ``where`` names it in error messages."""

    def __init__(self, key, spec, where=None):
        self.key = key
        self.where = where or f"SETUP.SAMPLERS.{key}"
        default = check_pycls_key(self.where, key)
        _require(isinstance(spec, dict), self.where, "needs a mapping with TYPE and its fields")
        self.type = spec.get("TYPE", "")
        kinds = GRID_TYPES + RANDOM_TYPES
        _require(self.type in kinds, f"{self.where}.TYPE", f"{self.type!r} is not one of {kinds}")
        for field in spec:
            _require(
                field in _FIELDS[self.type],
                f"{self.where}.{field}",
                f"not a field of a {self.type} sampler (fields: {sorted(_FIELDS[self.type])})",
            )
        if self.type in ("grid", "choice"):
            self._init_values(spec, default)
        else:
            self._init_range(spec, default)

    @property
    def is_random(self):
        return self.type in RANDOM_TYPES

    # -- validation --------------------------------------------------------------------------- #
    def _init_values(self, spec, default):
        where = f"{self.where}.VALUES"
        values = spec.get("VALUES", [])
        _require(isinstance(values, (list, tuple)) and len(values) > 0, where, "needs a list")
        self.values = [coerce_value(where, default, v) for v in values]
        reprs = [repr(v) for v in self.values]
        _require(len(set(reprs)) == len(reprs), where, f"repeats a value: {self.values}")

    def _init_range(self, spec, default):
        is_int = self.type == "int"
        kind = int if is_int else float
        _require(
            type(default) is kind,
            f"{self.where}.TYPE",
            f"{self.key} holds {type(default).__name__} values; use TYPE "
            + ("int" if type(default) is int else "float" if type(default) is float else "choice"),
        )
        self.is_int = is_int
        self.dist = spec.get("DIST", "uniform")
        _require(self.dist in DISTS, f"{self.where}.DIST", f"{self.dist!r} is not one of {DISTS}")
        where = f"{self.where}.RANGE"
        rng = [coerce_value(where, 0.0, v) if not is_int else v for v in spec.get("RANGE", [])]
        _require(
            len(rng) == 2 and all(_is_number(v) for v in rng),
            where,
            f"needs two numbers [LOW, HIGH], got {spec.get('RANGE')}",
        )
        if is_int:
            _require(all(isinstance(v, int) for v in rng), where, f"needs ints, got {rng}")
        self.low, self.high = rng
        _require(self.low <= self.high, where, f"LOW {self.low} exceeds HIGH {self.high}")
        if self.dist == "log_uniform":
            _require(self.low > 0, where, f"log_uniform needs LOW > 0, got {self.low}")
        self._init_quantize(spec.get("QUANTIZE", 1 if is_int else 0.0))

    def _init_quantize(self, q):
        where = f"{self.where}.QUANTIZE"
        if self.is_int:
            _require(isinstance(q, int) and q >= 1, where, f"needs an int >= 1, got {q!r}")
        else:
            q = coerce_value(where, 0.0, q)
            _require(_is_number(q) and q >= 0, where, f"needs a number >= 0, got {q!r}")
        self.q = q
        if q:
            for end in (self.low, self.high):
                _require(
                    _is_multiple(end, q),
                    f"{self.where}.RANGE",
                    f"{end} is not a multiple of QUANTIZE={q}",
                )

    # -- values ------------------------------------------------------------------------------- #
    def grid_values(self):
        return list(self.values)

    def draw(self, rng):
        """One random value."""
        if self.type == "choice":
            return self.values[rng.randrange(len(self.values))]
        if not self.q:
            x = self._draw_continuous(rng, self.low, self.high)
            return min(max(float(f"{x:.6g}"), self.low), self.high)
        k_low, k_high = round(self.low / self.q), round(self.high / self.q)
        x = self._draw_continuous(rng, (k_low - 0.5) * self.q, (k_high + 0.5) * self.q)
        k = min(max(round(x / self.q), k_low), k_high)
        return int(k * self.q) if self.is_int else float(f"{k * self.q:.12g}")

    def _draw_continuous(self, rng, low, high):
        if self.dist == "uniform":
            return rng.uniform(low, high)
        return math.exp(rng.uniform(math.log(low), math.log(high)))


def build_samplers(sc):
    """The validated samplers of a sweep config, in the order they are written."""
    samplers = []
    for key, spec in sc.SETUP.SAMPLERS.items():
        spec = dict(spec) if isinstance(spec, CfgNode) else spec
        sampler = Sampler(key, spec)
        _require(
            key not in sc.SETUP.OVERRIDES,
            sampler.where,
            f"{key} is also fixed in SETUP.OVERRIDES; keep one of the two",
        )
        samplers.append(sampler)
    return samplers


def validate_samplers(sc):
    """Checks SETUP.SAMPLERS and SETUP.NUM_CONFIGS together; raises ConfigError naming the key."""
    samplers = build_samplers(sc)
    _require(len(samplers) > 0, "SETUP.SAMPLERS", "name at least one key to vary")
    has_random = any(s.is_random for s in samplers)
    n = sc.SETUP.NUM_CONFIGS
    if has_random:
        _require(n > 0, "SETUP.NUM_CONFIGS", "must be > 0 to draw the random samplers")
    else:
        _require(
            n == 0,
            "SETUP.NUM_CONFIGS",
            f"{n} random draws asked, but every sampler is a grid (set 0, or use TYPE "
            f"{'/'.join(RANDOM_TYPES)})",
        )
    return samplers


def _random_draws(samplers, num, seed):
    """``num`` distinct draws (dicts) of the random samplers, reproducible by ``seed``."""
    samplers = [s for s in samplers if s.is_random]
    if not samplers:
        return [{}]
    rng, draws, seen = random.Random(seed), [], set()
    for _ in range(num * _MAX_DRAWS_PER_POINT):
        draw = {s.key: s.draw(rng) for s in samplers}
        if repr(draw) not in seen:
            seen.add(repr(draw))
            draws.append(draw)
            if len(draws) == num:
                return draws
    raise ConfigError(
        f"SETUP.NUM_CONFIGS: only {len(draws)} distinct random points found in "
        f"{num * _MAX_DRAWS_PER_POINT} draws, fewer than {num}; widen the ranges or ask fewer"
    )


def sample_points(sc):
    """The sweep's points: a list of {pycls key: value} in setup order (see the module doc)."""
    samplers = validate_samplers(sc)
    grid = [s for s in samplers if not s.is_random]
    products = list(itertools.product(*(s.grid_values() for s in grid)))
    points = []
    for draw in _random_draws(samplers, sc.SETUP.NUM_CONFIGS, sc.SETUP.SEED):
        for values in products:
            point = {**draw, **{s.key: v for s, v in zip(grid, values)}}
            points.append({s.key: point[s.key] for s in samplers})
    return points
