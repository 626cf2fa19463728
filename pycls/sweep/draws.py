"""Upstream pycls's quantised random draws (its pycls/sweep/random.py rules), from a
``random.Random``: what an upstream sweep file's samplers and its regnet_sampler draw.

Every draw lies in the closed range [LOW, HIGH] and is a multiple of q, of q's type:

- uniform: x in [LOW, HIGH + q), rounded down (each multiple equally likely)
- log_uniform: x log-uniform in (LOW - min(q, LOW / 2), HIGH], rounded up
- power2_uniform: 2**k for k uniform over the integers of [log2 LOW, log2 HIGH]
- power2_or_log_uniform: a power2_uniform draw; one >= q is redrawn log_uniform in
  [max(LOW, q), HIGH] with quantum min(HIGH, q) (small values are powers of 2, large ones
  multiples of q)

Upstream draws from numpy's global generator in chunks: the same file gives other points here
than there, from the same distributions.
"""

import math
from decimal import Decimal


def _quantize(x, q, up):
    """x rounded down (or up) to a multiple of q, of q's type (decimal arithmetic, as upstream)."""
    k = math.ceil(x / q) if up else math.floor(x / q)
    return type(q)(Decimal(k) * Decimal(str(q)))


def uniform(rng, low, high, q):
    return _quantize(rng.uniform(low, high + q), q, up=False)


def log_uniform(rng, low, high, q):
    x = math.exp(rng.uniform(math.log(low - min(q, low / 2)), math.log(high)))
    return min(_quantize(x, q, up=True), high)


def power2_uniform(rng, low, high, q):
    k = math.floor(rng.uniform(math.log2(low), math.log2(high) + 1))
    return _quantize(2 ** min(k, int(math.log2(high))), q, up=False)


def power2_or_log_uniform(rng, low, high, q):
    x = type(q)(power2_uniform(rng, low, high, low))
    return log_uniform(rng, max(low, q), high, min(high, q)) if x >= q else x


UPSTREAM_RAND_TYPES = {"uniform": uniform, "log_uniform": log_uniform}


def upstream_scalar(rng, dist, low, high, q):
    """A float_sampler / int_sampler draw of upstream pycls."""
    return UPSTREAM_RAND_TYPES[dist](rng, low, high, q)


# Upstream's regnet_sampler: field -> (type, default range, rule, quantum), in its draw order
REGNET_RULES = {
    "DEPTH": (int, [12, 28], uniform, 1),
    "W0": (int, [8, 256], log_uniform, 8),
    "WA": (float, [8.0, 256.0], log_uniform, 0.1),
    "WM": (float, [2.0, 3.0], log_uniform, 0.001),
    "GROUP_W": (int, [8, 128], power2_or_log_uniform, 8),
    "BOT_MUL": (float, [1.0, 1.0], power2_uniform, 1 / 128),
}


def _is_power2(x):
    return x > 0 and math.log2(x).is_integer()


def check_regnet_range(field, low, high):
    """None, or why [low, high] is no range of ``field`` (upstream's validate_rand checks)."""
    _, _, rule, q = REGNET_RULES[field]
    if low > high:
        return f"LOW {low} exceeds HIGH {high}"
    if rule is not uniform and low <= 0:
        return f"needs LOW > 0, got {low}"
    if rule in (power2_uniform, power2_or_log_uniform):
        if not (_is_power2(low) and _is_power2(high)):
            return f"[{low}, {high}]: both ends must be powers of 2"
        return None
    if Decimal(str(low)) % Decimal(str(q)) or Decimal(str(high)) % Decimal(str(q)):
        return f"[{low}, {high}]: both ends must be multiples of {q} (upstream's quantum)"
    return None


def regnet(rng, ranges):
    """{REGNET.<field>: value} of one upstream regnet_sampler draw over ``ranges``."""
    out = {}
    for field, (_, _, rule, q) in REGNET_RULES.items():
        out[f"REGNET.{field}"] = rule(rng, *ranges[field], q)
    return out
