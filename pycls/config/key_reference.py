"""The whole key reference of docs/configs.md, generated from the assembled tree
(``pycls.config.defaults``): every key, section by section, with its default, the values its
section's tables allow, what it means (a generated key's field text; a hand-written key's comment
above its definition) and the settings record's field it becomes. Regenerate the page with
``python -m pycls.config.key_reference docs/configs.md``; tests/config/test_key_reference.py keeps
it equal. Plain Python: no torch.
"""

import re
import sys

from pycls.config.defaults import DEFAULTS, OWNERS
from pycls.config.records import update_page
from pycls.config.sections import RECORDS, SECTIONS, key_reference

__all__ = ["key_tree_markdown", "page_with_reference", "tree_meanings"]

TREE = "the key tree"  # the markers of the whole reference on the page
_ASSIGNMENT = re.compile(r"^_C\.([A-Z0-9_.]+) = ")
_BOUNDS = (  # the tables of a section, in the words of a bound, the narrowest first
    (("BELOW_ONE", "NON_NEGATIVE"), "[0, 1)"),
    (("FRACTIONS",), "[0, 1]"),
    (("POSITIVE",), "> 0"),
    (("NON_NEGATIVE",), ">= 0"),
)


def _comments(path):
    """{key: the comment above its definition} of the hand-written keys in the section at
    ``path`` (a run of keys shares the comment above the run)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = _ASSIGNMENT.match(line)
        if not m or line.rstrip().endswith("CfgNode()"):
            continue
        j = i - 1
        while j >= 0 and _ASSIGNMENT.match(lines[j]):
            j -= 1
        text = []
        while j >= 0 and lines[j].startswith("#"):
            text.insert(0, lines[j].lstrip("#").strip())
            j -= 1
        out[m.group(1)] = " ".join(t for t in text if t)
    return out


def tree_meanings():
    """{key: what it means} of every key of the tree."""
    out = {}
    for section in SECTIONS:
        out.update(_comments(section.__file__))
        out.update(getattr(section, "REFERENCE", {}))
    return out


def _fields():
    """{key: the record fields it becomes}: a field's own key, or a key it is read from."""
    out = {}
    for record in RECORDS:
        for name, k in record.keys.items():
            out.setdefault(k.key, []).append(f"{record.name}.{name}")
        for name, (_, declared) in record.options.items():
            spec = declared.key
            for key in (*getattr(spec, "reads", ()), *getattr(spec, "also_reads", ())):
                out.setdefault(key, []).append(f"{record.name}.{name}")
    return out


def _values(section, key, default):
    choices = getattr(section, "CHOICES", {}).get(key)
    if choices:
        return ", ".join(f"`{c}`" for c in choices)
    for tables, text in _BOUNDS:
        if all(key in getattr(section, t, ()) for t in tables):
            return text
    if isinstance(default, bool):
        return "`True`, `False`"
    return "a list" if isinstance(default, list) else ""


def _leaves(node, prefix=""):
    for name, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield prefix + name, value


def _shown(value):
    return f"`{value}`" if isinstance(value, str) and value else f"`{value!r}`"


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def key_tree_markdown():
    """The reference of every key, one table per section in the tree's order."""
    meanings, fields = tree_meanings(), _fields()
    leaves = list(_leaves(DEFAULTS))
    parts = []
    for section in SECTIONS:
        name = section.__name__.rsplit(".", 1)[-1]
        rows = [
            f"#### `{name}` ([source](../pycls/config/sections/{name}.py))",
            "",
            "| key | default | values | becomes | what it means |",
            "|-----|---------|--------|---------|---------------|",
        ]
        for key, default in leaves:
            if OWNERS[key] != name:
                continue
            becomes = ", ".join(f"`{f}`" for f in fields.get(key, ()))
            cells = [f"`{key}`", _shown(default), _values(section, key, default), becomes,
                     meanings.get(key, "")]  # fmt: skip
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


def page_with_reference(page):
    """``page`` (docs/configs.md) with the records' parts and the whole tree generated again."""
    return update_page(key_reference(page), TREE, key_tree_markdown())


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/configs.md"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(page_with_reference(text))
