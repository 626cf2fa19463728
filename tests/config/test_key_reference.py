"""The whole key reference of docs/configs.md is generated from the assembled tree
(``pycls.config.key_reference``), and the tree is the one users had: every key with the default
and the values it always had (``default_tree.json``, written from the tree before its keys were
generated from the settings records)."""

import json
import os

import pytest

from pycls.config import key_reference
from pycls.config.defaults import DEFAULTS
from pycls.config.sections import SECTIONS
from tests.helpers import ROOT

TREE_FILE = os.path.join(os.path.dirname(__file__), "default_tree.json")
BOUNDS = ("POSITIVE", "NON_NEGATIVE", "BELOW_ONE", "FRACTIONS")


def _leaves(node, prefix=""):
    for name, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield prefix + name, value


def default_tree():
    """{key: {"default", "choices", "bounds"}} of every key: what a user can write and gets."""
    tables = {}
    for section in SECTIONS:
        for key, choices in getattr(section, "CHOICES", {}).items():
            tables.setdefault(key, {})["choices"] = list(choices)
        for table in BOUNDS:
            for key in getattr(section, table, ()):
                tables.setdefault(key, {}).setdefault("bounds", []).append(table)
    for entry in tables.values():
        entry.get("bounds", []).sort()
    return {key: {"default": v, **tables.get(key, {})} for key, v in sorted(_leaves(DEFAULTS))}


def test_the_default_tree_is_the_one_users_had():
    """Every key keeps its default, its values and its bounds, and none comes or goes unnoticed
    (a key added on purpose: add it to default_tree.json). Caught: a generated key whose field
    default differs from the hand-written key's (OptimizerSettings.muon_momentum 0.9), a value
    table a section forgot to take (engine's CHOICES without the generated ones)."""
    with open(TREE_FILE) as f:
        before = json.load(f)
    now = json.loads(json.dumps(default_tree()))  # tuples as lists, as the file has them
    changed = {k: (before.get(k), now.get(k)) for k in before.keys() | now.keys()
               if before.get(k) != now.get(k)}  # fmt: skip
    assert not changed, f"keys changed (was, is): {changed}"


def test_the_key_reference_of_the_docs_is_the_trees():
    """docs/configs.md's "Every key" is the tree's: each key once, with its default, values,
    field and meaning. Caught: a key added to a section (or a field's text changed) without
    regenerating the page."""
    with open(os.path.join(ROOT, "docs", "configs.md")) as f:
        page = f.read()
    assert key_reference.page_with_reference(page) == page, (
        "regenerate: python -m pycls.config.key_reference docs/configs.md"
    )
    table = key_reference.key_tree_markdown()
    for key, _ in _leaves(DEFAULTS):
        assert table.count(f"| `{key}` |") == 1, key
    meanings = key_reference.tree_meanings()
    assert all(meanings.get(key) for key, _ in _leaves(DEFAULTS))


def test_a_hand_written_key_reads_its_comment(tmp_path):
    """The comment above a run of keys is each key's meaning; a key without one has none."""
    path = tmp_path / "section.py"
    path.write_text("# Two keys\n# in a run\n_C.A.X = 1\n_C.A.Y = 2\n\n_C.A.Z = 3\n")
    assert key_reference._comments(str(path)) == {
        "A.X": "Two keys in a run",
        "A.Y": "Two keys in a run",
        "A.Z": "",
    }


def test_a_field_text_change_shows_in_the_table(monkeypatch):
    """The table is read from the sections' references, not written once (caught: a cached
    table)."""
    from pycls.config.sections import engine

    monkeypatch.setitem(engine.REFERENCE, "DDP.STATIC_GRAPH", "changed words")
    assert "changed words" in key_reference.key_tree_markdown()
    with pytest.raises(ValueError):
        key_reference.page_with_reference("a page without the markers")
