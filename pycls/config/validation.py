"""Which values and combinations of keys are valid: ``assert_cfg`` raises ``ConfigError`` naming
the first bad key (and the allowed values where there is a fixed set).

It runs, in this order: what holds for every key (list items are numbers, numbers are finite),
every section's refusals of another library's spellings (``check_spellings``), value tables and
checks (``pycls.config.sections``), the models' own checks of the arguments the keys give, and the
engine x feature rule (``pycls.engines.support``) over the features the sections declare.
"""

import math

from yacs.config import CfgNode

from pycls.config.defaults import DEFAULTS
from pycls.config.sections import SECTIONS
from pycls.config.sections.engine import engine_name
from pycls.config.sections.key_checks import check_choices, check_ranges, get, show
from pycls.engines import support
from pycls.errors import ConfigError

__all__ = ["FEATURES", "assert_cfg", "engine_feature_table", "engine_name", "get"]


def _features(sections):
    """Every section's features: {feature: (key, when on)}, each declared once."""
    out = {}
    for section in sections:
        for name, feature in getattr(section, "FEATURES", {}).items():
            assert name not in out, f"feature {name!r} is declared twice"
            out[name] = feature
    return out


# Feature of the engine x feature rule -> (the key that turns it on, when the config does)
FEATURES = _features(SECTIONS)
_unknown = {f for _, f in support.UNSUPPORTED} - set(FEATURES)
assert not _unknown, f"the engine x feature rule names features no section declares: {_unknown}"


def engine_feature_table():
    """The engine x feature table of docs/distributed.md."""
    return support.markdown_table({name: key for name, (key, _) in FEATURES.items()})


def _leaves(c, prefix=""):
    """(dotted key, value) of every key that is not a section."""
    for key, value in c.items():
        if isinstance(value, CfgNode):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_list_items(c):
    """Every list key holds numbers (every list in the key tree does: sizes, strides, steps,
    betas, means, class indices), never lists, mappings, strings, booleans or nulls: one of those
    would otherwise fail later, deep in a model or a comparison, with a traceback."""
    for key, value in _leaves(c):
        if isinstance(value, (list, tuple)):
            bad = [v for v in value if not _is_number(v)]
            if bad:
                raise ConfigError(f"{key}: holds {show(bad[0])}, but its values are numbers")


def _check_finite(c):
    """Every number (and number in a list) is finite: .inf and .nan are never meaningful here."""
    for key, value in _leaves(c):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                where = f" in {show(value)}" if isinstance(value, (list, tuple)) else ""
                raise ConfigError(f"{key}: must be a finite number, got {v!r}{where}")


def _check_engine(c):
    """The engine x feature rule: a feature the config turns on that its engine cannot run is
    refused, naming the feature's key and the engine."""
    enabled = {name: key for name, (key, on) in FEATURES.items() if on(c)}
    for key, msg in support.conflicts(engine_name(c), enabled):
        raise ConfigError(f"{key}: {msg}")


def assert_cfg(c=None):
    """Checks every value and combination; raises ConfigError naming the first bad key."""
    c = DEFAULTS if c is None else c
    _check_list_items(c)
    _check_finite(c)
    for section in SECTIONS:  # a value spelled as another library spells it: said so, first
        if hasattr(section, "check_spellings"):
            section.check_spellings(c)
    for section in SECTIONS:
        check_choices(c, section)
    for section in SECTIONS:
        check_ranges(c, section)
    for section in SECTIONS:
        if hasattr(section, "check"):
            section.check(c)
    for section in SECTIONS:
        if hasattr(section, "check_arguments"):
            section.check_arguments(c)
    _check_engine(c)
