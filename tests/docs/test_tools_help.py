"""Every tool's --help says what it does in whole sentences."""

import contextlib
import glob
import io
import os
import runpy
import sys

import pytest

from tests.helpers import ROOT

TOOLS = sorted(glob.glob(os.path.join(ROOT, "tools", "*.py")))
TOOLS += sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))


@pytest.mark.parametrize("path", TOOLS, ids=os.path.basename)
def test_help_describes_the_tool_in_whole_sentences(path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        runpy.run_path(path, run_name="__main__")
    assert e.value.code == 0
    paragraphs = [p.strip() for p in out.getvalue().split("\n\n")]
    first, after = paragraphs[1], paragraphs[2]  # paragraphs[0] is the usage line
    assert first.endswith((".", ":")), first
    if first.endswith(":"):  # announces more: the description must go on
        assert not after.startswith(("options:", "positional arguments:")), first
