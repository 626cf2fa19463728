"""The tests' own layout (tests/README.md): every test file lies in the folder of what it tests,
no test file imports another (what several share is in tests/helpers/ or tests/conftest.py),
every test file the docs name exists, the tests that start a SLURM cluster start nothing
unless asked to, the tests that share a process group or a trained run share one worker, and a
run that leaves a process behind fails."""

import ast
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, scaled
from tests.helpers import slurm as local_slurm

TESTS = Path(ROOT) / "tests"
# The folders of tests, each mirroring a package of pycls or a part of the repository around it
FOLDERS = {
    "config", "models", "datasets", "engines", "distributed", "checkpoint", "optim", "core",
    "sweep", "benchmarks", "docs", "end_to_end",
}  # fmt: skip
# The house rules read from the source, and this file: about the whole repository
TOP_LEVEL = {"test_layers.py", "test_layout.py"}
HELPERS = {"tests.helpers", "tests.conftest"}


def _test_files():
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_file_lies_in_the_folder_of_what_it_tests():
    misplaced = []
    for path in _test_files():
        rel = path.relative_to(TESTS)
        top = rel.parts[0] if len(rel.parts) > 1 else None
        if (top is None and rel.name not in TOP_LEVEL) or (top is not None and top not in FOLDERS):
            misplaced.append(str(path.relative_to(ROOT)))
    assert not misplaced, (
        "a test file goes in the tests/ folder of the package it tests (tests/README.md): "
        f"{', '.join(sorted(FOLDERS))}; misplaced: {misplaced}"
    )
    for folder in FOLDERS:  # packages: two folders may hold files of one name
        assert (TESTS / folder / "__init__.py").exists(), f"tests/{folder}/__init__.py is missing"


def test_test_file_names_are_unique_across_folders():
    """The docs name a test file by its name alone at times: one name, one file."""
    seen = {}
    for path in _test_files():
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not [paths for paths in seen.values() if len(paths) > 1]


def _imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node.lineno, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # the module and each name (it may be a module)
            module = "." * node.level + (node.module or "")
            yield node.lineno, [module, *(f"{module}.{alias.name}" for alias in node.names)]


def test_no_test_module_imports_another():
    """A helper that two test files need lives in tests/helpers/ (or a fixture in conftest.py):
    a test file importing another runs the other's module code and ties their layouts."""
    found = []
    for path in [*TESTS.rglob("*.py")]:
        for line, modules in _imported_modules(ast.parse(path.read_text())):
            for module in modules:
                last = module.split(".")[-1]
                ours = module.startswith("tests.") and not any(
                    module == h or module.startswith(h + ".") for h in HELPERS
                )
                if (
                    module.startswith(".")
                    or (ours and last.startswith("test_"))
                    or (module.split(".")[0].startswith("test_"))
                ):
                    found.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert not found, "\n".join(found)


def test_helpers_import_no_test_module_nor_pytest_fixtures_by_name():
    for path in (TESTS / "helpers").rglob("*.py"):
        text = path.read_text()
        assert "@pytest.fixture" not in text, f"{path}: fixtures belong in a conftest.py"


def _named_test_paths():
    """(file, path) for every tests/... path written in the docs, the README, BENCHMARKS.md, the
    package, tools/, benchmarks/, setup.py, .ci/run and the tests."""
    files = [Path(ROOT, name) for name in ("README.md", "BENCHMARKS.md", "setup.py", ".ci/run")]
    for folder in ("docs", "pycls", "tools", "benchmarks", "tests"):
        files += [p for p in Path(ROOT, folder).rglob("*") if p.suffix in (".md", ".py", ".sh")]
    for path in files:
        for match in re.finditer(r"(?<![\w/.])tests/[\w/]*\w\.(?:py|json|md)\b", path.read_text()):
            yield path, match.group(0)


def test_every_test_file_the_docs_name_exists():
    named = list(_named_test_paths())
    assert len(named) > 20  # the docs do name test files
    missing = [
        f"{p.relative_to(ROOT)}: {name}" for p, name in named if not Path(ROOT, name).exists()
    ]
    assert not missing, "\n".join(missing)


# ------------------------------------------------------------------------------------------------ #
# SLURM: nothing started unasked
# ------------------------------------------------------------------------------------------------ #

# What the cluster script and the tests would call to start or use a cluster
SLURM_COMMANDS = ("slurmctld", "slurmd", "munged", "munge", "unmunge", "sinfo", "scontrol", "srun",
                  "sbatch", "squeue", "scancel")  # fmt: skip


def _fake_slurm(bin_dir, record):
    """SLURM and munge commands that only write their name to ``record`` and fail, but munge,
    which answers as a running munged would (so that a start goes no further than slurmctld,
    writing nothing outside its folder)."""
    bin_dir.mkdir()
    for name in SLURM_COMMANDS:
        tool = bin_dir / name
        status = 0 if name in ("munge", "unmunge") else 1
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{record}"\nexit {status}\n')
        tool.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _slurm_test_files():
    """The test files with a test marked slurm or using the slurm fixture; each such test
    carries the mark (which the unasked run skips)."""
    files, unmarked = [], []
    for path in _test_files():
        tree = ast.parse(path.read_text())
        holds = False
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            marked = any("mark.slurm" in ast.unparse(d) for d in node.decorator_list)
            uses = "slurm" in [a.arg for a in node.args.args]
            holds |= marked or uses
            if uses and not marked:
                unmarked.append(f"{path.relative_to(ROOT)}::{node.name}")
        if holds:
            files.append(str(path.relative_to(ROOT)))
    assert not unmarked, f"tests using the slurm fixture without @pytest.mark.slurm: {unmarked}"
    return files


def test_the_cluster_fixture_would_show_on_the_fake_commands(tmp_path, monkeypatch):
    """The control for the next test: the fixture's start calls the (fake) SLURM commands."""
    record = tmp_path / "called.txt"
    monkeypatch.setenv("PATH", _fake_slurm(tmp_path / "bin", record))
    monkeypatch.setenv("PYCLS_SLURM_DIR", str(tmp_path / "cluster"))
    with pytest.raises(RuntimeError):
        local_slurm.start()
    assert "slurmd" in record.read_text()  # it went as far as the daemons


@pytest.mark.skipif(sys.platform == "win32", reason="shell scripts as fake commands")
def test_a_plain_run_of_the_slurm_tests_starts_nothing_and_says_how_to(tmp_path):
    """`pytest` on the files holding the slurm tests, on a machine with SLURM and munge
    installed (here fakes that record every call) and PYCLS_TEST_SLURM unset: every slurm test
    skips, says how to run it, and no SLURM or munge command ran."""
    record = tmp_path / "called.txt"
    env = {k: v for k, v in os.environ.items() if k != "PYCLS_TEST_SLURM"}
    env.update(PATH=_fake_slurm(tmp_path / "bin", record), PYCLS_SLURM_DIR=str(tmp_path / "c"))
    files = _slurm_test_files()
    assert "tests/distributed/test_slurm.py" in files
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "slurm", "-p", "no:cacheprovider",
           "-p", "no:xdist", *files]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=scaled(300)
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ skipped", summary) and "passed" not in summary, out.stdout[-3000:]
    assert "PYCLS_TEST_SLURM=1" in out.stdout
    assert not record.exists(), record.read_text()


# ------------------------------------------------------------------------------------------------ #
# Time limits grow with the load
# ------------------------------------------------------------------------------------------------ #

_LOADED = """
import os, time

# the load average the conftest reads as the first test starts: 4 per CPU; then none
_LOADS = [4.0 * len(os.sched_getaffinity(0))]
os.getloadavg = lambda: (_LOADS.pop(0) if _LOADS else 0.0,) * 3

def test_on_a_busy_machine():
    time.sleep(2)

def test_on_an_idle_machine():
    time.sleep(2)
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="the CPUs of this process")
def test_pytest_timeouts_and_the_tests_limits_grow_with_the_load(tmp_path, monkeypatch):
    """Broke when a test's time limit was fixed (pytest-timeout's, a deadline, a wait) and a busy
    machine failed it without a hang (the README's command at load 13-18 on 2 cores): a 1 s
    pytest-timeout lets a 2 s test pass at a load of 4 per CPU and stops it when idle, and
    ``scaled`` grows with the 1- or 5-minute load average over the CPUs, never below 1."""
    (tmp_path / "test_loaded.py").write_text(_LOADED)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:xdist",
           "-p", "no:cacheprovider", "--timeout", "1", "--rootdir", str(tmp_path),
           str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=scaled(300))
    summary = out.stdout.strip().splitlines()[-1]
    assert "1 failed, 1 passed" in summary, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Failed: Timeout (>1.0s)" in out.stdout, out.stdout[-3000:]
    assert "FAILED" in out.stdout and "test_loaded.py::test_on_an_idle_machine" in out.stdout
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 3.0, 1.0))
    assert scaled(10) == 40
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 2.0, 9.0))
    assert scaled(10) == 10


# ------------------------------------------------------------------------------------------------ #
# Two workers, one shared fixture; nothing left behind
# ------------------------------------------------------------------------------------------------ #

_SCRATCH = """
import os, subprocess, pytest
from tests import conftest

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"set up in {os.getpid()}\\n")

@pytest.mark.parametrize("case", range(6))
def test_shares(shared, case):
    pass

@pytest.mark.parametrize("case", range(6))
def test_alone(case):
    pass

@pytest.fixture(scope="session")
def kept():
    process = subprocess.Popen(["sleep", "300"])  # never ended: a cluster whose stop failed
    conftest._KEPT.add(process.pid)
    return process

def test_keeps_a_process(kept):
    pass
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
def test_two_workers_share_a_files_fixture_and_the_run_fails_on_a_process_left(tmp_path):
    """`-n 2` as the README runs it: the tests using a module-scoped fixture of their file run on
    one worker, which sets it up once (xdist's workers do not group by themselves), and a process
    the tests kept past their files' checks fails the run at its end, named and killed."""
    (tmp_path / "test_scratch.py").write_text(_SCRATCH)
    record = tmp_path / "setups.txt"
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.conftest",
           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "RECORD": str(record)}
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=scaled(300)
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(record.read_text().splitlines()) == 1, record.read_text()
    assert "13 passed" in out.stdout, out.stdout[-3000:]
    end = r"left 1 process\(es\) running at the end of the run.*\n  pid (\d+): sleep 300"
    left = re.search(end, out.stdout)
    assert left, out.stdout[-3000:]
    with contextlib.suppress(OSError):  # killed: gone, or a zombie without a command line
        assert b"sleep" not in Path(f"/proc/{left.group(1)}/cmdline").read_bytes()
