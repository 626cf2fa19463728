"""The built wheel, installed outside the checkout, runs the quickstart from an empty folder.

The wheel is built from a copy of the package files (nothing from tests/ or tools/), installed into
a fresh venv that sees this interpreter's site-packages as plain paths: torch and the other
dependencies are reused, not downloaded again, while this checkout's pycls (an editable install's
finder, or the current directory) is not importable there. Only requirements missing from this
interpreter would be installed.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig

import pytest

import pycls
from tests.helpers import ROOT, TINY, scaled

pytestmark = pytest.mark.slow

PACKAGE_FILES = ("pycls", "configs", "setup.py", "pyproject.toml", "README.md", "LICENSE")
SHRUNK = [*TINY, "OPTIM.MAX_EPOCH", "1", "TRAIN.EVAL_PERIOD", "1", "TRAIN.CHECKPOINT_PERIOD", "1"]


def _run(cmd, cwd, env=None):
    result = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=scaled(600)
    )
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{cmd} failed:\n{output}"
    return result


def _build_wheel(tmp):
    src = os.path.join(tmp, "src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in PACKAGE_FILES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(src, name), ignore=ignore)
        else:
            shutil.copy(path, os.path.join(src, name))
    dist = os.path.join(tmp, "dist")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    _run([*pip_wheel, "-w", dist, src], cwd=tmp)
    (wheel,) = os.listdir(dist)
    return os.path.join(dist, wheel)


def _venv_reusing_this_torch(tmp):
    """A venv without pip whose sys.path ends with this interpreter's site-packages."""
    venv = os.path.join(tmp, "venv")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = os.path.join(venv, "bin", "python")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp)
    # A .pth line adds a folder to sys.path without running that folder's own .pth files, so
    # the editable install of this checkout stays invisible in the venv
    parents = [*site.getsitepackages(), sysconfig.get_path("purelib"), _installed_here(tmp)]
    with open(os.path.join(purelib.stdout.strip(), "reuse_parent.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(p for p in parents if os.path.isdir(p))) + "\n")
    return venv, python


def _installed_here(tmp):
    """A folder where this version of pycls-vit looks installed (as this checkout is in CI,
    editable), so the test meets that case on any machine."""
    info = os.path.join(tmp, "installed_here", f"pycls_vit-{pycls.__version__}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: pycls-vit\nVersion: {pycls.__version__}\n")
    open(os.path.join(info, "RECORD"), "w").close()
    return os.path.dirname(info)


MISSING = """
import importlib.metadata as md, re
missing = []
for req in md.requires("pycls-vit") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[<>=!~;\\[ ]", req, maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(req)
print("\\n".join(missing))
"""


def _install(python, wheel, tmp):
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q"]
    # --force-reinstall: pip sees this checkout's own (editable) pycls-vit through the .pth line
    # and would otherwise call the wheel installed already; it leaves that one alone
    _run([*pip, "--no-deps", "--force-reinstall", wheel], cwd=tmp)
    missing = _run([python, "-c", MISSING], cwd=tmp).stdout.split()
    if missing:
        _run([*pip, *missing], cwd=tmp)


def _test_errors(stdout):
    lines = [ln.split("json_stats: ", 1)[1] for ln in stdout.splitlines() if "json_stats: " in ln]
    return [json.loads(ln)["top1_err"] for ln in lines if '"test_epoch"' in ln]


def test_wheel_runs_quickstart_from_empty_folder(tmp_path):
    wheel = _build_wheel(str(tmp_path))
    assert os.path.basename(wheel).startswith("pycls_vit-")  # not Meta's "pycls"
    venv, python = _venv_reusing_this_torch(str(tmp_path))
    _install(python, wheel, str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([python, "-c", "import pycls; print(pycls.__file__)"], str(empty), env).stdout
    assert where.startswith(venv), where  # the wheel's pycls, not the checkout's
    commands = {
        "console": [os.path.join(venv, "bin", "pycls"), "--cfg", "quickstart"],
        "module": [python, "-m", "pycls", "--cfg", "configs/quickstart.yaml"],
    }
    for name, cmd in commands.items():
        out_dir = str(empty / name)
        result = _run([*cmd, "--mode", "train", *SHRUNK, "OUT_DIR", out_dir], str(empty), env)
        assert len(_test_errors(result.stdout)) == 1, result.stdout[-2000:]
        assert os.path.isfile(os.path.join(out_dir, "config.yaml"))
    assert sorted(os.listdir(empty)) == ["console", "module"]  # nothing written beside the runs
    _installed_commands_work(venv, empty, tmp_path, env)


COMMANDS = ("export", "consolidate", "prepare", "sweep-setup", "sweep-launch", "sweep-collect")
COMMANDS += ("sweep-analyze",)


# Each command's --help, through the installed ``pycls`` script's entry point, in one
# interpreter (a fresh one per command would import torch seven times): {command: usage}
HELPS = """
import contextlib, importlib.metadata as md, io, json, sys
(script,) = [e for e in md.entry_points(group="console_scripts") if e.name == "pycls"]
main, usages = script.load(), {}
for command in sys.argv[1:]:
    sys.argv = ["pycls", command, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main()
        except SystemExit as e:
            assert e.code in (0, None), (command, e.code)
    usages[command] = out.getvalue()
print(json.dumps(usages))
"""


def _installed_commands_work(venv, empty, tmp_path, env):
    """Every command of a checkout's tools/ is a command of the installed ``pycls``: each
    answers --help, and an export, a preparation and a sweep setup run from the empty folder.
    (The --help answers come from one interpreter calling the installed script's entry point;
    the script itself runs the training, the export, the preparation and the sweep setup.
    Checked to fail with "sweep-collect" missing from pycls.__main__.COMMANDS.)"""
    pycls_cmd = os.path.join(venv, "bin", "pycls")
    python = os.path.join(venv, "bin", "python")
    usages = json.loads(_run([python, "-c", HELPS, *COMMANDS], str(empty), env).stdout)
    assert list(usages) == list(COMMANDS)
    for command, usage in usages.items():
        assert usage.startswith(f"usage: pycls {command}"), usage[:200]
    checkpoint = empty / "console" / "checkpoints" / "model_epoch_0001.pyth"
    exported = tmp_path / "exported.safetensors"
    _run([pycls_cmd, "export", str(checkpoint), "--format", "safetensors", "--out", str(exported)],
         str(empty), env)  # fmt: skip
    from safetensors.torch import load_file

    assert "pos_embed" in load_file(str(exported))
    shards = tmp_path / "shards"
    _run([pycls_cmd, "prepare", "--dataset", "digits", "--splits", "test", "--out", str(shards)],
         str(empty), env)  # fmt: skip
    assert (shards / "test" / "index.json").is_file()
    sweeps = tmp_path / "sweeps"
    sweep = ["--sweep-cfg", "configs/sweeps/quickstart_lr.yaml", "ROOT_DIR", str(sweeps)]
    _run([pycls_cmd, "sweep-setup", *sweep], str(empty), env)  # a bundled sweep, by its name
    assert sorted(os.listdir(sweeps / "quickstart_lr" / "cfgs")) == ["0000.yaml", "0001.yaml"]
    assert sorted(os.listdir(empty)) == ["console", "module"]
