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

``regnet`` (key ``REGNET`` only) draws REGNET.DEPTH, W0, WA, WM, GROUP_W and BOT_MUL together by
upstream pycls's rules (pycls/sweep/draws.py): fields DEPTH, W0, WA, WM, GROUP_W, BOT_MUL, each
[LOW, HIGH] (defaults [12, 28], [8, 256], [8.0, 256.0], [2.0, 3.0], [8, 128], [1.0, 1.0]).

``DIST`` is ``uniform`` (default) or ``log_uniform`` (LOW > 0; uniform in log space, the usual
choice for learning rates and weight decay). With ``QUANTIZE`` q > 0 values are multiples of q,
LOW and HIGH must be multiples of q, and every multiple in the range gets the probability mass of
the interval within q/2 of it (so the end points are not under-sampled). Unquantised floats are
kept to 6 significant digits, the precision of the json_stats logs. ``QUANTIZE_RULE: upstream``
(what an upstream sweep file's samplers become) quantises as upstream pycls does instead: uniform
draws in [LOW, HIGH + q) and rounds down, log_uniform draws in (LOW - min(q, LOW/2), HIGH] and
rounds up.

The points: random draws are the outer loop (``SETUP.NUM_CONFIGS`` distinct draws from a
``random.Random(SETUP.SEED)``), the grid product the inner one, in the order the keys are written
with the last key varying fastest.
"""

import itertools
import math
import random

from yacs.config import CfgNode

from pycls.config import ConfigError
from pycls.config import require as _require
from pycls.sweep import draws
from pycls.sweep.keys import check_pycls_key, coerce_value

GRID_TYPES = ("grid",)
RANDOM_TYPES = ("choice", "float", "int", "regnet")
DISTS = ("uniform", "log_uniform")
QUANTIZE_RULES = ("centered", "upstream")
_FIELDS = {
    "grid": {"TYPE", "VALUES"},
    "choice": {"TYPE", "VALUES"},
    "float": {"TYPE", "RANGE", "DIST", "QUANTIZE", "QUANTIZE_RULE"},
    "int": {"TYPE", "RANGE", "DIST", "QUANTIZE", "QUANTIZE_RULE"},
    "regnet": {"TYPE", *draws.REGNET_RULES},
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
        self.keys = [key]
        self.where = where or f"SETUP.SAMPLERS.{key}"
        _require(isinstance(spec, dict), self.where, "needs a mapping with TYPE and its fields")
        self.type = spec.get("TYPE", "")
        if self.type == "regnet":  # a group of keys, not one
            _require(key == "REGNET", self.where, "TYPE regnet is the sampler of key REGNET")
        else:
            default = check_pycls_key(self.where, key)
        kinds = GRID_TYPES + RANDOM_TYPES
        _require(self.type in kinds, f"{self.where}.TYPE", f"{self.type!r} is not one of {kinds}")
        for field in spec:
            _require(
                field in _FIELDS[self.type],
                f"{self.where}.{field}",
                f"not a field of a {self.type} sampler (fields: {sorted(_FIELDS[self.type])})",
            )
        if self.type == "regnet":
            self._init_regnet(spec)
        elif self.type in ("grid", "choice"):
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
        seen = set()
        for value in self.values:
            _require(repr(value) not in seen, where, f"repeats the value {value!r}")
            seen.add(repr(value))

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
        self.rule = spec.get("QUANTIZE_RULE", "centered")
        _require(
            self.rule in QUANTIZE_RULES,
            f"{self.where}.QUANTIZE_RULE",
            f"{self.rule!r} is not one of {QUANTIZE_RULES}",
        )
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
        _require(
            q or self.rule != "upstream",
            where,
            "QUANTIZE_RULE upstream needs QUANTIZE > 0 (upstream always quantises)",
        )
        if q:
            for end in (self.low, self.high):
                _require(
                    _is_multiple(end, q),
                    f"{self.where}.RANGE",
                    f"{end} is not a multiple of QUANTIZE={q}",
                )

    def _init_regnet(self, spec):
        self.ranges = {}
        for field, (kind, default_range, _, _) in draws.REGNET_RULES.items():
            where = f"{self.where}.{field}"
            rng = list(spec.get(field, default_range))
            _require(
                len(rng) == 2 and all(_is_number(v) for v in rng),
                where,
                f"needs two numbers [LOW, HIGH], got {rng}",
            )
            if kind is int:
                _require(all(isinstance(v, int) for v in rng), where, f"needs ints, got {rng}")
            rng = [kind(v) for v in rng]
            problem = draws.check_regnet_range(field, *rng)
            _require(problem is None, where, problem or "")
            self.ranges[field] = rng
        self.keys = [f"REGNET.{field}" for field in draws.REGNET_RULES]

    # -- values ------------------------------------------------------------------------------- #
    def grid_values(self):
        return list(self.values)

    def draw_items(self, rng):
        """{pycls key: random value} of every key this sampler sets."""
        if self.type == "regnet":
            return draws.regnet(rng, self.ranges)
        return {self.key: self.draw(rng)}

    def draw(self, rng):
        """One random value."""
        if getattr(self, "rule", "") == "upstream":
            return draws.upstream_scalar(rng, self.dist, self.low, self.high, self.q)
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
        for k in sampler.keys:
            _require(
                k not in sc.SETUP.OVERRIDES,
                sampler.where,
                f"{k} is also fixed in SETUP.OVERRIDES; keep one of the two",
            )
        samplers.append(sampler)
    return samplers


def validate_samplers(sc):
    """Checks SETUP.SAMPLERS and SETUP.NUM_CONFIGS together, and counts the points before any is
    made (``count_points``); raises ConfigError naming the key."""
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
    count, limit = count_points(samplers, n), sc.SETUP.MAX_POINTS
    if count > limit:
        sizes = " x ".join(str(len(s.values)) for s in samplers if not s.is_random) or "1"
        draws = f" x {n} random draws" if has_random else ""
        raise ConfigError(
            f"SETUP.MAX_POINTS: the sweep has {count:,} points (grid {sizes}{draws}), more than "
            f"SETUP.MAX_POINTS={limit:,}; sweep fewer values, or raise SETUP.MAX_POINTS"
        )
    return samplers


def count_points(samplers, num_configs):
    """How many points the samplers give: the grid's size x max(num_configs, 1), without making
    them (an int of any size)."""
    return math.prod(len(s.values) for s in samplers if not s.is_random) * max(num_configs, 1)


def _random_draws(samplers, num, seed, max_draws=0, accept=None):
    """``num`` distinct draws (dicts) of the random samplers, reproducible by ``seed``; a draw
    ``accept`` refuses (the constraints) is skipped. At most ``max_draws`` (0: 100 x num) tries."""
    samplers = [s for s in samplers if s.is_random]
    if not samplers:
        return [{}]
    tries = max_draws or num * _MAX_DRAWS_PER_POINT
    rng, found, seen, rejected = random.Random(seed), [], set(), 0
    for _ in range(tries):
        draw = {}
        for s in samplers:
            draw.update(s.draw_items(rng))
        if repr(draw) in seen:
            continue
        seen.add(repr(draw))
        if accept is not None and not accept(draw):
            rejected += 1
            continue
        found.append(draw)
        if len(found) == num:
            return found
    refused = f" ({rejected} refused by SETUP.CONSTRAINTS)" if rejected else ""
    raise ConfigError(
        f"SETUP.NUM_CONFIGS: only {len(found)} distinct random points found in {tries} "
        f"draws{refused}, fewer than {num}; widen the ranges, loosen the constraints, raise "
        "SETUP.MAX_DRAWS or ask fewer"
    )


def iter_points(sc, accept=None):
    """The sweep's points, made one at a time: {pycls key: value} in setup order (see the module
    doc). ``accept(point)`` (the constraints) must hold for every point a random draw gives."""
    samplers = validate_samplers(sc)
    grid = [s for s in samplers if not s.is_random]
    keys = [k for s in samplers for k in s.keys]

    def crossed(draw):
        for values in itertools.product(*(s.grid_values() for s in grid)):
            point = {**draw, **{s.key: v for s, v in zip(grid, values)}}
            yield {k: point[k] for k in keys}

    def accept_draw(draw):
        return all(accept(point) for point in crossed(draw))

    num, seed, max_draws = sc.SETUP.NUM_CONFIGS, sc.SETUP.SEED, sc.SETUP.MAX_DRAWS
    for draw in _random_draws(samplers, num, seed, max_draws, accept and accept_draw):
        yield from crossed(draw)


def sample_points(sc, accept=None):
    """The sweep's points as a list (at most SETUP.MAX_POINTS, checked before any is made)."""
    return list(iter_points(sc, accept))
