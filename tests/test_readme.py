"""The README's commands work as written: every code block a CPU machine can run without
downloads runs here, in order, and does what the text around it says.

Blocks marked ``<!-- readme-test: skip (why) -->`` (GPUs, clusters, ImageNet, downloads) and the
``ci:test`` block (this test suite) are skipped. Paths under /tmp/ move into a fresh folder, and
training is cut to a tiny model and EPOCHS epochs by KEY VALUE overrides appended to the command
(later pairs win), so the whole README runs in a few minutes on 2 cores. The error transcripts
(``$ command`` followed by its output) are run and their stderr compared line for line.
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

README = os.path.join(ROOT, "README.md")
EPOCHS = 1
# The tiny quickstart, EPOCHS epochs (depth 2: the pipeline needs a block per stage)
CUT = ["VIT.DEPTH", "2", "VIT.WIDTH", "32", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64"]
CUT += ["TRAIN.BATCH_SIZE", "64", "LOG_PERIOD", "10", "OPTIM.MAX_EPOCH", str(EPOCHS)]
CUT_BY_MODE = {
    "train": CUT,
    "test": CUT,
    "lrfind": [*CUT, "LRFIND.NUM_ITERS", "20"],
    "time": [*CUT, "PREC_TIME.WARMUP_ITER", "1", "PREC_TIME.NUM_ITER", "2"],
}
SWEEP_CUT = [f"SETUP.OVERRIDES.{k}" if i % 2 == 0 else k for i, k in enumerate(CUT)]
SWEEP_CUT += ["LAUNCH.MAX_PARALLEL", "1"]

_BLOCK = re.compile(r"(?:<!-- (?P<tag>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)


def readme_blocks():
    """(tag, language, body) of every fenced code block, in order."""
    with open(README) as f:
        text = f.read()
    return [(m["tag"] or "", m["lang"], m["body"]) for m in _BLOCK.finditer(text)]


def _is_skipped(tag):
    return tag.startswith("readme-test: skip") or tag == "ci:test"


def shell_commands(body):
    """The commands of a bash block: continuation lines joined, comments and pip dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for part in line.split("&&"):
            part = part.strip()
            if not part.startswith("pip "):  # the environment is installed already
                commands.append(part)
    return commands


def runnable_steps():
    """("bash", command) / ("transcript", (command, expected stderr)) / ("python", code)."""
    steps = []
    for tag, lang, body in readme_blocks():
        if _is_skipped(tag):
            continue
        if lang == "bash":
            steps += [("bash", c) for c in shell_commands(body)]
        elif lang == "python":
            steps.append(("python", body))
        elif lang == "" and body.startswith("$ "):
            for chunk in body.split("$ ")[1:]:
                command, *expected = chunk.strip().splitlines()
                steps.append(("transcript", (command, expected)))
    return steps


STEPS = runnable_steps()


def _argv(command, tmp):
    """The command's argv with /tmp/ paths moved to tmp, the comment dropped, sizes cut."""
    command = command.split(" # ")[0].replace("/tmp/", f"{tmp}/")
    command = command.replace("model_epoch_0040", f"model_epoch_{EPOCHS:04d}")
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    tool = next((os.path.basename(a) for a in argv if a.startswith("tools/")), "")
    if tool == "run_net.py":
        mode = argv[argv.index("--mode") + 1]
        argv += CUT_BY_MODE.get(mode, [])
    elif tool.startswith("sweep_"):
        argv += ["ROOT_DIR", f"{tmp}/sweeps", *SWEEP_CUT]
    return argv


def _run(argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _stats(out_dir, kind):
    found = []
    with open(os.path.join(out_dir, "stdout.log")) as f:
        for line in f:
            if "json_stats: " in line:
                s = json.loads(line.split("json_stats: ", 1)[1])
                found += [s] if s["_type"] == kind else []
    return found


def _out_dir(argv):
    return argv[argv.index("OUT_DIR") + 1] if "OUT_DIR" in argv else None


def _check(command, argv, proc, tmp):
    """What the README's text says about this command."""
    out_dir = _out_dir(argv)
    if "--mode train" in command:
        assert "nothing to train" not in proc.stdout, command
        (last, *_) = reversed(_stats(out_dir, "test_epoch"))
        assert last["epoch_num"] == EPOCHS, last
        if "DATA.CLASSES" in command:  # some of the 359 held-out digits
            assert 0 < last["num_samples"] < 359, last
        else:
            assert last["num_samples"] == 359, last
        for name in ("config.yaml", "stdout.log", "checkpoints", "training_curves.png"):
            assert os.path.exists(os.path.join(out_dir, name)), name
    if "--mode info" in command:
        lines = [line for line in proc.stdout.splitlines() if "json_stats: " in line]
        (cx,) = [json.loads(line.split("json_stats: ", 1)[1]) for line in lines]
        claimed = float(re.search(r"~(\d+) M params", command).group(1))
        assert cx["params"] / 1e6 == pytest.approx(claimed, rel=0.01)
    if "--mode time" in command:
        if not torch.cuda.is_available():  # AMP.CPU_LEVEL auto: decided by the CPU's bfloat16
            from pycls.engines.precision import cpu_bf16_flags

            kept = "note: AMP.LEVEL O1 (bfloat16) runs as is on this CPU"
            fp32 = "note: AMP.LEVEL O1 runs as O0 on the CPU"
            assert (kept if cpu_bf16_flags() else fp32) in proc.stdout
        assert len(_stats(out_dir, "iter_times")) == 1
    if "--mode test" in command:  # the quickstart's own weights: the same number as its run
        (stats,) = _stats(out_dir, "test_epoch")
        trained = _stats(f"{tmp}/q", "test_epoch")[-1]
        assert stats["num_samples"] == 359 and stats["top1_err"] == trained["top1_err"]
    if "DATA_LOADER.BACKEND shards" in command:  # exactly the default loader's result
        shards = _stats(out_dir, "test_epoch")[-1]["top1_err"]
        assert shards == _stats(f"{tmp}/q", "test_epoch")[-1]["top1_err"]
    if "--dataset digits" in command:
        for split in ("train", "test"):
            assert os.path.isfile(f"{tmp}/digits_shards/{split}/index.json")
    if "CURRICULUM.ENABLED True" in command:
        assert _stats(out_dir, "train_epoch")[0]["im_size"] == 8
    if "--mode lrfind" in command:
        for name in ("lrfind.csv", "lrfind.png"):
            assert os.path.getsize(os.path.join(out_dir, name)) > 0
    if "sweep_setup.py" in command and "quickstart_lr" in command:
        assert sorted(os.listdir(f"{tmp}/sweeps/quickstart_lr/cfgs")) == ["0000.yaml", "0001.yaml"]
    if "sweep_launch.py" in command and "--dry-run" not in command:
        assert "done   0000" in proc.stdout and "done   0001" in proc.stdout
    if "sweep_collect.py" in command:
        assert os.path.isfile(f"{tmp}/sweeps/quickstart_lr/sweep.json")
    if "sweep_analyze.py" in command:
        assert os.path.isfile(f"{tmp}/sweeps/quickstart_lr/analysis/summary.md")
    if "vit_b16_lr_wd" in command and "--dry-run" in command:
        assert "would launch" in proc.stdout


def test_readme_has_runnable_and_marked_blocks():
    kinds = [kind for kind, _ in STEPS]
    assert kinds.count("bash") >= 15 and kinds.count("python") == 2 and "transcript" in kinds
    for tag, lang, body in readme_blocks():
        # what cannot run here must say so
        words = ("/data/", "/shared/", "srun", "--nproc_per_node 8", 'weights="')
        needs_more = lang in ("bash", "python") and any(w in body for w in words)
        assert not needs_more or _is_skipped(tag), body[:200]


def test_every_training_command_has_its_own_out_dir():
    """Auto-resume picks up any checkpoint in OUT_DIR: commands sharing one would resume each
    other's finished runs instead of training."""
    seen = {}
    for kind, command in STEPS:
        if kind == "bash" and "tools/run_net.py" in command and "--mode info" not in command:
            argv = shlex.split(command.split(" # ")[0])
            out_dir = _out_dir(argv)
            assert out_dir, f"no OUT_DIR: {command}"
            assert out_dir not in seen, f"{command}\nshares {out_dir} with\n{seen.get(out_dir)}"
            seen[out_dir] = command


@pytest.fixture(scope="module")
def readme_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("readme"))


@pytest.mark.slow  # every runnable README command, in order: see the report for its runtime
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_readme_step(step, readme_tmp):
    kind, what = STEPS[step]
    if kind == "python":
        namespace = {}
        exec(compile(what, f"README python block (step {step})", "exec"), namespace)
        if "loss" in namespace:
            assert math.isfinite(namespace["loss"].item())
        if "model" in namespace and "reset_classifier" in what:
            model = namespace["model"]
            assert model.complexity()["params"] == sum(p.numel() for p in model.parameters())
        return
    if kind == "transcript":
        command, expected = what
        argv = _argv(command, readme_tmp)
        proc = _run(argv)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == expected
        return
    argv = _argv(what, readme_tmp)
    proc = _run(argv)
    assert proc.returncode == 0, f"{what}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr and "UserWarning" not in proc.stderr, proc.stderr
    _check(what, argv, proc, readme_tmp)
