"""What the sections' checks share: reading a dotted key, showing a value in a message, the
one-line refusal naming the key, and the value tables a section may declare (``CHOICES``,
``POSITIVE``, ``NON_NEGATIVE``, ``BELOW_ONE``, ``FRACTIONS``), checked for every section by
``pycls.config.validation.assert_cfg``; which keys a table's row reads (``keys_read``).
"""

import reprlib

from yacs.config import CfgNode

from pycls.errors import require

__all__ = [
    "CfgNode",
    "both",
    "check_choices",
    "check_ranges",
    "get",
    "keys_read",
    "require",
    "show",
]

# How much of a value an error message shows
_SHOWN_CHARS = 80

_REPR = reprlib.Repr()
_REPR.maxlist = _REPR.maxtuple = 8
_REPR.maxdict, _REPR.maxstring, _REPR.maxother = 4, _SHOWN_CHARS, _SHOWN_CHARS


def get(cfg_node, key):
    """Value of a dotted key such as "VIT.PATCH_SIZE"."""
    node = cfg_node
    for part in key.split("."):
        node = node[part]
    return node


def show(value):
    """``repr(value)``, shortened for an error message: a list of a hundred thousand values (or
    a string of a megabyte) is named by its start and its length."""
    text = _REPR.repr(value)
    if len(text) > _SHOWN_CHARS:
        text = text[:_SHOWN_CHARS] + "..."
    if isinstance(value, (list, tuple)) and len(value) > 8:
        text += f" ({len(value)} values)"
    return text


def both(ok, key, other, why):
    """A pair of keys that cannot be used together: the message names both."""
    require(ok, key, f"cannot be used with {other}: {why}")


def check_choices(c, section):
    """Each key of the section's ``CHOICES`` holds one of its values."""
    for key, allowed in getattr(section, "CHOICES", {}).items():
        value = get(c, key)
        require(value in allowed, key, f"{show(value)} is not one of {list(allowed)}")


def check_ranges(c, section):
    """The section's ``POSITIVE`` keys are > 0, ``NON_NEGATIVE`` >= 0, ``BELOW_ONE`` < 1 and
    ``FRACTIONS`` in [0, 1]."""
    for key in getattr(section, "POSITIVE", ()):
        require(get(c, key) > 0, key, f"must be > 0, got {get(c, key)!r}")
    for key in getattr(section, "NON_NEGATIVE", ()):
        require(get(c, key) >= 0, key, f"must be >= 0, got {get(c, key)!r}")
    for key in getattr(section, "BELOW_ONE", ()):
        require(get(c, key) < 1, key, f"must be < 1, got {get(c, key)!r}")
    for key in getattr(section, "FRACTIONS", ()):
        require(0 <= get(c, key) <= 1, key, f"must be in [0, 1], got {get(c, key)!r}")


class _KeyRecorder:
    """A read-only view of a config that records the dotted keys read through it."""

    def __init__(self, node, read, prefix=""):
        self._node, self._read, self._prefix = node, read, prefix

    def __getattr__(self, name):
        value = self._node[name]
        if isinstance(value, dict):
            return _KeyRecorder(value, self._read, f"{self._prefix}{name}.")
        self._read.add(self._prefix + name)
        return value


def keys_read(reader, c):
    """The dotted keys ``reader(c)`` reads (a row of an argument or settings table)."""
    read = set()
    reader(_KeyRecorder(c, read))
    return read
