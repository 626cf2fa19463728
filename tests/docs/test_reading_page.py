"""docs/reading_pycls.md names the path one epoch of the quickstart takes, and that path stays
small: measured under coverage by benchmarks/reading_path.py (the page's own command)."""

import os

import pytest

from tests.helpers import ROOT, load_tool, scaled

# The lines of the functions one quickstart epoch runs may not pass this (measured 5,784 on
# 2026-12-07; the page and the README state it)
LINE_BUDGET = 6100
PAGE = os.path.join(ROOT, "docs", "reading_pycls.md")
REGENERATE = "python benchmarks/reading_path.py --write docs/reading_pycls.md"

reading_path = load_tool("reading_path", folder="benchmarks")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # about 15 s of CPU on an idle machine (the quickstart epoch under coverage)
    return reading_path.measure(str(tmp_path_factory.mktemp("reading")), timeout=scaled(300))


@pytest.mark.slow
def test_every_module_the_quickstart_epoch_runs_is_on_the_page(path):
    """Catches a module entering the path without a row on the page (shown by deleting the
    pycls.core.evaluation row), and a row left for a module the path no longer runs."""
    with open(PAGE) as f:
        listed = reading_path.page_modules(f.read())
    measured = [module for module, _ in path["modules"]]
    missing = [m for m in measured if m not in listed]
    stale = [m for m in listed if m not in measured]
    assert not missing and not stale, (
        f"docs/reading_pycls.md is out of date: run by the quickstart epoch but not on the page:"
        f" {missing}; on the page but not run: {stale} (measured: {path['functions']} functions,"
        f" {path['lines']} lines in {len(measured)} modules). Regenerate: {REGENERATE}"
    )


@pytest.mark.slow
def test_the_functions_the_quickstart_epoch_runs_stay_within_the_budget(path):
    """Catches the path growing past the budget (shown with LINE_BUDGET at 5,000)."""
    assert path["lines"] <= LINE_BUDGET, (
        f"one quickstart epoch now runs {path['functions']} functions of {path['lines']:,} lines"
        f" in {len(path['modules'])} modules, over the budget of {LINE_BUDGET:,}: make the path"
        f" shorter, or raise the budget here, in docs/reading_pycls.md and README.md, and"
        f" regenerate: {REGENERATE}"
    )


def test_the_page_and_the_readme_state_the_budget():
    """Catches the budget changed here and not where a reader sees it."""
    for name in ("README.md", os.path.join("docs", "reading_pycls.md")):
        with open(os.path.join(ROOT, name)) as f:
            assert f"{LINE_BUDGET:,} lines" in f.read(), f"{name} does not state the budget"


def test_a_function_counts_its_own_lines_and_runs_by_its_body(tmp_path):
    """Catches a nested function counted twice, or a function counted as run because its def
    line ran at import (the measurement's two rules, on a made-up module; shown by counting a
    function's whole span, and by counting its def line as part of its body)."""
    source = tmp_path / "m.py"
    source.write_text(
        "def outer():\n"  # 1
        "    x = 1\n"  # 2
        "    def inner():\n"  # 3
        "        return x\n"  # 4
        "    return inner\n"  # 5
        "\n"
        "@staticmethod\n"  # 7
        "def never():\n"  # 8
        "    return 2\n"  # 9
    )
    by_name = {f["name"]: f for f in reading_path.functions_of(str(source))}
    assert {n: f["lines"] for n, f in by_name.items()} == {"outer": 3, "outer.inner": 2, "never": 3}
    traced = {"lines": {str(source): [1, 2, 3, 5, 7, 8]}, "order": [], "imported": []}
    path = reading_path.summarize(traced)
    assert [name for _, fns in path["modules"] for name, _ in fns] == ["outer"]
    assert (path["lines"], path["functions"], path["statements"]) == (3, 1, 2)
