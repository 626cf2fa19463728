"""The config keys of a settings record, generated from its fields (``pycls.options.option``):
each field's key with its default, its reference text, the value tables that check it, the
record's argument table ({field: how the config gives it}), the features it turns on, and the
record's part of the key reference in docs/configs.md.

A section declares a record's keys with ``RecordKeys(Record, "GROUP", home="section")`` and
takes its part with ``.section("section")``: the keys whose field names no other owner. Any
dataclass of options and any key group: a field may be fed from keys other sections declare
(``ReadFrom``), have no key (``NoKey``) or a key another section declares (``Key(owner=...)``).
"""

import dataclasses
import re
from collections.abc import Callable

from yacs.config import CfgNode

from pycls.options import NoKey, ReadFrom, options_of

__all__ = ["RecordKeys", "SectionKeys", "update_page"]

# The value tables of pycls.config.sections.key_checks each bound fills
_TABLES = {
    "positive": ("positive",),
    "non_negative": ("non_negative",),
    "rate": ("non_negative", "below_one"),
    "fraction": ("fractions",),
}
_BOUND_TEXT = {"positive": "> 0", "non_negative": ">= 0", "rate": "[0, 1)", "fraction": "[0, 1]"}


@dataclasses.dataclass
class _FieldKey:
    """One field's key, resolved: its dotted name, owner, default, values and reader."""

    field: str
    key: str
    owner: str
    default: object
    choices: tuple
    bounds: str
    meaning: str
    why: str
    read: Callable


@dataclasses.dataclass
class SectionKeys:
    """What one section takes of a record: its keys (``tree``, to become the section's ``_C``),
    their value tables, their reference texts and the features they turn on."""

    tree: CfgNode
    choices: dict
    positive: list
    non_negative: list
    below_one: list
    fractions: list
    reference: dict
    features: dict


def _value(c, path):
    for part in path:
        c = getattr(c, part)
    return c


def _reader(keys, read):
    """``row(c)``: the argument from the keys' values (through ``read``), read by attribute, so
    that ``key_checks.keys_read`` sees which keys a row reads."""
    paths = [tuple(k.split(".")) for k in keys]
    if read is None and len(paths[0]) == 2:  # GROUP.KEY, most rows: read as a hand-written row
        group, name = paths[0]
        return lambda c: getattr(getattr(c, group), name)
    if read is None:
        (path,) = paths
        return lambda c: _value(c, path)
    return lambda c: read(*(_value(c, p) for p in paths))


class _Arguments:
    """The record's arguments as ``c`` gives them, by attribute, each read when asked for."""

    def __init__(self, table, c):
        self._table, self._c = table, c

    def __getattr__(self, name):
        return self._table[name](self._c)


class RecordKeys:
    """The keys of ``record``'s fields in the key group ``group`` ("VIT"), declared by the section
    ``home`` unless a field's key names another owner. ``applies(c)``: whether the config builds
    the record (the features it turns on count only then); default always."""

    def __init__(self, record, group, *, home, applies=None):
        self.record, self.group, self.home = record, group, home
        self.applies = applies or (lambda c: True)
        self.options = options_of(record)
        self.keys = {}  # field -> _FieldKey, for the fields with a key of their own
        self.arguments = {}  # field -> row(c): the argument table
        for name, (default, declared) in self.options.items():
            self._add(name, default, declared)

    @property
    def name(self):
        """The record's class name, which marks its part of the key reference."""
        return self.record.__name__

    def _qualified(self, key):
        """A field's key: dotted, as written; else in the record's group (top level without)."""
        return key if "." in key or not self.group else f"{self.group}.{key}"

    def _add(self, name, default, declared):
        spec = declared.key
        if isinstance(spec, NoKey):
            return
        if isinstance(spec, ReadFrom):
            self.arguments[name] = _reader(spec.reads, spec.read)
            return
        key = self._qualified(spec.name or name.upper())
        read = spec.read or (tuple if isinstance(default, tuple) and not spec.also_reads else None)
        keys = [key, *spec.also_reads]
        self.keys[name] = _FieldKey(
            name,
            key,
            spec.owner or self.home,
            spec.default_for(default),
            spec.choices or declared.choices,
            spec.bounds or declared.bounds,
            declared.meaning,
            spec.why,
            _reader(keys, read),
        )
        self.arguments[name] = self.keys[name].read

    def arguments_of(self, c):
        """{field: argument} of every field the config gives."""
        return {name: row(c) for name, row in self.arguments.items()}

    # -- one section's part ---------------------------------------------------------------- #
    def section(self, owner):
        """The keys ``owner`` declares, with their tables, reference and features."""
        own = [k for k in self.keys.values() if k.owner == owner]
        tree, tables = CfgNode(), {t: [] for t in ("positive", "non_negative", "below_one",
                                                   "fractions")}  # fmt: skip
        for k in own:
            *groups, leaf = k.key.split(".")
            node = tree
            for g in groups:
                node = node.setdefault(g, CfgNode())
            node[leaf] = k.default
            # A key that may hold None (unset) is bounded by the record's own check, which the
            # section's check_arguments runs naming the key: the tables compare numbers
            for table in _TABLES.get(k.bounds, ()) if k.default is not None else ():
                tables[table].append(k.key)
        return SectionKeys(
            tree=tree,
            choices={k.key: k.choices for k in own if k.choices},
            reference={k.key: _reference_text(k) for k in own},
            features=self._features(owner),
            **tables,
        )

    def _features(self, owner):
        """{feature: (its key, when the config turns it on)} of the fields whose key ``owner``
        declares (a field fed from other keys: the home section's)."""
        out = {}
        for name, (default, declared) in self.options.items():
            feature = declared.feature
            if feature is None or self._owner(name) != owner:
                continue
            key = self.keys[name].key if name in self.keys else declared.key.reads[0]
            out[feature.name] = (key, self._feature_on(name, default, feature))
        return out

    def _owner(self, name):
        return self.keys[name].owner if name in self.keys else self.home

    def _feature_on(self, name, default, feature):
        table, applies = self.arguments, self.applies
        if feature.on is not None:
            on = feature.on
        else:
            on = lambda a: getattr(a, name) != default  # noqa: E731
        return lambda c: bool(applies(c) and on(_Arguments(table, c)))

    # -- the key reference ------------------------------------------------------------------ #
    def markdown(self):
        """The record's part of the key reference (docs/configs.md): one row per key, then the
        fields fed from other sections' keys and those without a key."""
        rows = [
            "| key | default | values | argument | what it means |",
            "|-----|---------|--------|----------|---------------|",
        ]
        for name, k in self.keys.items():
            cells = [f"`{k.key}`", _shown(k.default), _values(k), f"`{name}`", _reference_text(k)]
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines = ["\n".join(rows)]
        fed = [
            f"`{name}` (`{'`, `'.join(declared.key.reads)}`)"
            for name, (_, declared) in self.options.items()
            if isinstance(declared.key, ReadFrom)
        ]
        if fed:
            lines.append(f"Read from other sections' keys: {', '.join(fed)}.")
        keyless = [
            f"`{name}` ({declared.key.why})"
            for name, (_, declared) in self.options.items()
            if isinstance(declared.key, NoKey)
        ]
        if keyless:
            lines.append(f"No key: {'; '.join(keyless)}.")
        return "\n\n".join(lines) + "\n"


def _reference_text(k):
    return f"{k.meaning}. Key: {k.why}" if k.why else k.meaning


def _shown(value):
    return f"`{value}`" if isinstance(value, str) and value else f"`{value!r}`"


def _values(k):
    if k.choices:
        return ", ".join(f"`{c}`" for c in k.choices)
    if k.bounds:
        return _BOUND_TEXT[k.bounds]
    if isinstance(k.default, bool):
        return "`True`, `False`"
    return "a list" if isinstance(k.default, list) else ""


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markers(name):
    return (
        f"<!-- generated from {name} (pycls.config.records): edit the fields, not this text -->",
        f"<!-- end of the text generated from {name} -->",
    )


def update_page(page, name, text):
    """``page`` with the text between the markers of ``name`` replaced by ``text``; raises
    ValueError when the page lacks them."""
    start, end = _markers(name)
    pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.DOTALL)
    if not pattern.search(page):
        raise ValueError(f"the page has no markers {start!r} ... {end!r}")
    return pattern.sub(lambda _: f"{start}\n{text}{end}", page, count=1)
