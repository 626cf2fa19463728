"""YAML config and sweep files read strictly and within bounds, before any value is built from
them; an unknown key is named with the known keys closest to it.

- A key written twice in one mapping is an error: plain YAML keeps the last value silently, so an
  edited file would train on a value nobody sees.
- ``check_config_text``: besides, a key must be a name (a string), and the file must stay small
  once its aliases are expanded: a few hundred bytes of nested anchors (``&a [*b, *b, ...]``)
  name billions of values, which whatever walks them (yacs copying mappings, an error message
  showing a list) would build. The size is counted on the composed node graph, where an alias
  is one shared node, so the count itself costs only the file's own nodes.
- ``decode_config``: a file's bytes as text: UTF-8 only, anything else named in one line.

A leaf module (it imports only pycls.errors): the config loader calls it before yacs parses.
"""

import codecs
import difflib
import re

import yaml  # PyYAML: what yacs itself parses with

from pycls.errors import ConfigError

# A config file is a few KB; a sweep-sized list of a thousand values is a few tens of KB
MAX_CONFIG_BYTES = 1 << 20
# Values (scalars, lists, mappings) a config may hold once its aliases are expanded
MAX_CONFIG_NODES = 200_000

_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),  # before UTF-16: its BOM starts with UTF-16's
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


class _DuplicateKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in lines:
                option = getattr(self, "option", "--cfg")
                where = getattr(self, "where", None) or f"{option}: {self.name}"
                raise ConfigError(
                    f"{where}: key {key!r} appears twice in one section (lines {lines[key]} and "
                    f"{line}); keep one"
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


class _ConfigLoader(_DuplicateKeyLoader):
    def construct_mapping(self, node, deep=False):
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                raise ConfigError(
                    f"{self.where}: key {key!r} (line {key_node.start_mark.line + 1}) is not a "
                    "name; config keys are words such as OPTIM or BASE_LR"
                )
        return super().construct_mapping(node, deep=deep)


def check_duplicate_keys(text, name, option="--cfg"):
    """Raises ConfigError naming the key and both lines when ``text`` (the YAML file ``name``,
    given with the command-line ``option``) writes a key twice in one mapping, at any depth."""
    loader = _DuplicateKeyLoader(text)
    loader.name, loader.option = name, option
    try:
        loader.get_single_data()
    finally:
        loader.dispose()


def decode_config(data, name):
    """The text of a config file's bytes ``data`` (UTF-8, with or without a byte-order mark);
    raises ConfigError naming the file and what it is instead."""
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"--cfg: {name} is {len(data)} bytes; a config file is at most {MAX_CONFIG_BYTES}"
        )
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise ConfigError(f"--cfg: {name} is {encoding} text; save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        byte = data[e.start : e.start + 1].hex()
        raise ConfigError(
            f"--cfg: {name} is not UTF-8 text (byte 0x{byte} at offset {e.start}); save it as UTF-8"
        ) from None


def check_config_text(text, name, where=None):
    """Raises ConfigError naming the file ``name`` (``where``: how the message names the text,
    by default ``--cfg: name``) when the YAML ``text`` is too large, expands (through aliases)
    to more than MAX_CONFIG_NODES values or refers to itself, uses a key that is not a string,
    or writes a key twice in one mapping. Nothing is built before the size is known."""
    where = where or f"--cfg: {name}"
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{where} is {len(text)} characters; a config is at most {MAX_CONFIG_BYTES} bytes"
        )
    loader = _ConfigLoader(text)
    loader.name, loader.where = name, where
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_expanded_size(node, where)
            loader.construct_document(node)
    finally:
        loader.dispose()


def _children(node):
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expanded_size(root, where):
    """Counts the nodes of ``root`` with every alias expanded, each shared node counted once per
    reference (memoised: linear in the distinct nodes); refuses a count over the bound and an
    alias inside its own anchor (an endless value)."""
    sizes, open_nodes, stack = {}, set(), [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > MAX_CONFIG_NODES:
                raise ConfigError(
                    f"{where}: the value at line {node.start_mark.line + 1} expands to more than "
                    f"{MAX_CONFIG_NODES} values through its aliases (*name); write the values out"
                )
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise ConfigError(
                f"{where}: the value at line {node.start_mark.line + 1} refers to itself through "
                "an alias (*name)"
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def dotted_keys(tree, prefix=""):
    """Every key of a nested mapping (a yacs CfgNode) as a dotted name, groups included."""
    keys = []
    for key, value in tree.items():
        keys.append(prefix + str(key))
        if isinstance(value, dict):
            keys += dotted_keys(value, f"{prefix}{key}.")
    return keys


def did_you_mean(key, known):
    """ " (did you mean A?)" naming the keys of ``known`` closest to the unknown ``key`` (case
    ignored; difflib's ratio of 0.75 or more, and within 0.1 of the closest), or "" when none is
    close."""
    by_upper = {k.upper(): k for k in known}
    wanted = str(key).upper()
    close = difflib.get_close_matches(wanted, list(by_upper), n=3, cutoff=0.75)
    if not close:
        return ""
    ratios = [difflib.SequenceMatcher(None, wanted, c).ratio() for c in close]
    close = [c for c, r in zip(close, ratios) if r >= ratios[0] - 0.1]
    return f" (did you mean {' or '.join(by_upper[c] for c in close)}?)"


# yacs's words for a value of another type than the key's default, and a type's in ours
_TYPE_MISMATCH = re.compile(
    r"Type mismatch \(<class '(\w+)'> vs\. <class '(\w+)'>\) with values \((.*)\) for config key",
    re.DOTALL,
)
_TYPE_WORDS = {"float": "a number", "int": "a whole number", "bool": "True or False",
               "str": "text", "list": "a list", "tuple": "a list", "NoneType": "None"}  # fmt: skip
_SHOWN_VALUE = 120  # characters of the value shown (a list may be megabytes)


def type_mismatch_in_words(key, message):
    """yacs's "Type mismatch (<class 'float'> vs. <class 'str'>) with values (...)" for ``key``
    as one sentence (what the key takes, what it got); None for any other message."""
    found = _TYPE_MISMATCH.match(message)
    if found is None:
        return None
    wanted, given, values = found.groups()
    value = values.split(" vs. ", 1)[-1] if " vs. " in values else values
    value = value[:_SHOWN_VALUE] + "..." if len(value) > _SHOWN_VALUE else value
    shown = repr(value) if given == "str" else value
    words = _TYPE_WORDS.get
    return f"{key}: takes {words(wanted, wanted)}, got {words(given, given)}: {shown}"
