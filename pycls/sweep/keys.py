"""The pycls config keys a sweep may set (its overrides and samplers): checked against the
defaults and coerced to each key's type."""

from yacs.config import CfgNode

from pycls import config
from pycls.errors import ConfigError, require
from pycls.yaml_keys import did_you_mean, dotted_keys

# Keys the sweep sets for every run itself
RESERVED_KEYS = ("OUT_DIR", "TRAIN.AUTO_RESUME")


def check_pycls_key(where, key):
    """The default value of dotted pycls ``key``; ConfigError naming ``where`` if it is unknown."""
    require(key not in RESERVED_KEYS, where, f"{key} is set by the sweep for every run")
    defaults = config.get_default_cfg()
    try:
        value = config.get(defaults, key)
    except (KeyError, TypeError):
        hint = did_you_mean(key, dotted_keys(defaults))
        raise ConfigError(f"{where}: {key!r} is not a pycls config key{hint}") from None
    require(
        not isinstance(value, CfgNode),
        where,
        f"{key} is a group, not a key (write dotted keys such as OPTIM.MAX_EPOCH)",
    )
    return value


def coerce_value(where, default, value):
    """``value`` in the type of the pycls key's ``default``: 1 -> 1.0 and '1e-3' -> 0.001 for
    float keys (PyYAML reads 1e-3 without a dot as a string)."""
    if isinstance(default, float) and not isinstance(value, bool):
        if isinstance(value, int):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: {value!r} is not a number") from None
    return value
