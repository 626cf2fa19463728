"""One declaration per option: a field of a settings record (a dataclass of plain arguments, such
as ``pycls.models.vit.args.VitArgs``) that says, beside its default, what the option means, which
values it takes, whether it is counted or training-only, and which config key gives it.

``option(...)`` declares such a field. From it the config generates the option's key, the key's
default, its reference text, its value tables and the row of the record's argument table
(``pycls.config.records``); the record checks its own values against the same declaration
(``check_options``). Plain Python, nothing of pycls imported: any layer may declare a record.

A field's key is, unless it says otherwise, ``GROUP.NAME`` (NAME the field's name in capitals,
GROUP the record's key group), holding the field's default and values, declared by the config
section that generates the record's keys. ``Key(...)`` says where it differs (another name, an
older one kept; another default or values, an ``auto`` the config resolves; another group or
owning section) and why; ``ReadFrom(...)`` feeds the field from keys other sections declare;
``NoKey`` gives it none, saying why.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "BOUNDS",
    "Feature",
    "Key",
    "NoKey",
    "Option",
    "ReadFrom",
    "check_options",
    "option",
    "options_of",
]

# What a number may be: the test and how a message says it (None passes: an option left unset)
BOUNDS = {
    "positive": (lambda v: v > 0, "positive"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
    "rate": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}

_SAME = object()  # a key's default: the field's


@dataclass(frozen=True)
class Key:
    """The field's own config key, where it is not ``GROUP.NAME`` with the field's default and
    values. ``why`` is required whenever its name, default, values or reading differ (another
    group or owner alone needs none), and shows in the key's reference.

    - ``name``: the key, "NAME" in the record's group (a top-level key where the record has no
      group) or "GROUP.NAME" (an upstream or older name kept: ``Key("STEM_TYPE", why="upstream
      pycls's name")``);
    - ``default``, ``choices``: the key's, where they differ from the field's (a value the field
      cannot hold, such as an ``auto`` that ``read`` resolves);
    - ``read``: the argument from the key's value (and from ``also_reads``' values, in order);
      without it the value as it is (a tuple field's key holds a list, read back as a tuple);
    - ``also_reads``: other keys the argument depends on (full keys, declared elsewhere);
    - ``group``: the key's group, where not the record's (a record whose options sit in several
      groups: ``EngineSettings``'s TRAIN.COMPILE beside AMP.FLOAT8); "" keeps the record's;
    - ``owner``: the config section that declares the key, where not the one that generates the
      record's keys (the fewer-token keys of the ViT: "tokens");
    - ``bounds``: the key's, where a value ``read`` maps differs from the field's bounds (a 0 that
      reads as None: "non_negative" beside the field's "positive").
    """

    name: str = ""
    why: str = ""
    default: object = _SAME
    choices: tuple = ()
    read: Callable | None = None
    also_reads: tuple[str, ...] = ()
    group: str = ""
    owner: str = ""
    bounds: str = ""

    def default_for(self, field_default):
        """The key's default: its own, or the field's (a tuple as a list: YAML's)."""
        value = field_default if self.default is _SAME else self.default
        return list(value) if isinstance(value, tuple) else value

    def differs(self):
        return bool(self.name or self.default is not _SAME or self.choices or self.read
                    or self.also_reads or self.bounds)  # fmt: skip


@dataclass(frozen=True)
class ReadFrom:
    """The argument comes from keys that other sections declare (``reads``, full keys), through
    ``read`` (of their values, in order) or as the one key's value; the field has no key."""

    reads: tuple[str, ...]
    read: Callable | None = None

    def __init__(self, *reads, read=None):
        object.__setattr__(self, "reads", reads)
        object.__setattr__(self, "read", read)


@dataclass(frozen=True)
class NoKey:
    """The field has no config key; ``why`` says why (the config never sets it)."""

    why: str


@dataclass(frozen=True)
class Feature:
    """A feature of the engine x feature rule the option turns on (``name``, as the rule's rows
    name it): when ``on(args)`` is true (``args``: the record's arguments by attribute), by
    default when the argument differs from the field's default."""

    name: str
    on: Callable | None = None


@dataclass(frozen=True)
class Option:
    """What ``option(...)`` declares about a field (its ``metadata["option"]``)."""

    meaning: str
    choices: tuple = ()
    bounds: str = ""
    training_only: bool = False
    counted: bool = True
    key: Key | ReadFrom | NoKey = Key()
    feature: Feature | None = None


def option(default, meaning, *, choices=(), bounds="", training_only=False, counted=True,
           key=None, feature=None):  # fmt: skip
    """A field of a settings record, with its default and everything else said of the option:

    - ``meaning``: what it means (the config key's reference);
    - ``choices``: the values it may take (a tuple of the module that owns them);
    - ``bounds``: "positive", "non_negative", "rate" ([0, 1)) or "fraction" ([0, 1]);
    - ``training_only``: it leaves the parameters (names, shapes, what they compute) as they
      are, so a checkpoint resumes under other values;
    - ``counted``: it changes the analytic complexity (FLOPs, parameters, activations);
    - ``key``: ``Key(...)``, ``ReadFrom(...)`` or ``NoKey(why)``; None: the plain key;
    - ``feature``: the engine x feature rule's feature it turns on (a name, or ``Feature``).
    """
    if bounds and bounds not in BOUNDS:
        raise ValueError(f"bounds {bounds!r} is not one of {list(BOUNDS)}")
    if isinstance(feature, str):
        feature = Feature(feature)
    declared = Option(meaning, tuple(choices), bounds, training_only, counted, key or Key(),
                      feature)  # fmt: skip
    _check_key(declared.key)
    if isinstance(declared.key, Key) and declared.key.bounds not in ("", *BOUNDS):
        raise ValueError(f"bounds {declared.key.bounds!r} is not one of {list(BOUNDS)}")
    return dataclasses.field(default=default, metadata={"option": declared})


def _check_key(spec):
    """Raises ValueError for a key declaration that leaves out what the config needs."""
    if isinstance(spec, Key) and spec.differs() and not spec.why:
        raise ValueError(f"a key that differs from its field says why: {spec}")
    if isinstance(spec, Key):
        several = bool(spec.also_reads)
    else:
        several = isinstance(spec, ReadFrom) and len(spec.reads) > 1
    if several and not spec.read:
        raise ValueError(f"an argument read from several keys says how (read=...): {spec}")


def options_of(record):
    """{field name: (its default, its ``Option``)} of a record class or instance, in field
    order; a field declared without ``option`` has none and is left out."""
    return {
        f.name: (f.default, f.metadata["option"])
        for f in dataclasses.fields(record)
        if "option" in f.metadata
    }


def check_options(record, error):
    """Raises ``error(name, message)`` for the first field of ``record`` whose value is not one
    of its choices or breaks its bounds (None passes the bounds: an option left unset)."""
    for name, declared in _checked(type(record)):
        value = getattr(record, name)
        if declared.choices and value not in declared.choices:
            options = ", ".join(repr(a) for a in declared.choices)
            raise error(name, f"unknown {name} {value!r}; expected one of: {options}")
        if declared.bounds and value is not None:
            test, text = BOUNDS[declared.bounds]
            if not test(value):
                raise error(name, f"{name} must be {text}, got {value!r}")


_CHECKED = {}  # record class -> its fields with choices or bounds (a record checks itself often)


def _checked(cls):
    if cls not in _CHECKED:
        options = ((n, d) for n, (_, d) in options_of(cls).items())
        _CHECKED[cls] = [(n, d) for n, d in options if d.choices or d.bounds]
    return _CHECKED[cls]
