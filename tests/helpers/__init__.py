"""What several test files share: the repository's paths, a tiny fast quickstart, a tiny ViT,
free ports, a raised preemption flag, the tools loaded as modules and time limits scaled with the
machine's load (``scaled``). More in this package:
``distributed`` (gloo process groups, the tiny ViT the engines train), ``cifar`` (CIFAR files)."""

import importlib.util
import os
import shutil
import socket
import threading

import torch

from pycls import config
from pycls.checkpoint import single_file as checkpoint
from pycls.core.logging import load_json_stats
from pycls.models import VisionTransformer

# The repository: three levels up from tests/helpers/__init__.py
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
RUN_NET = os.path.join(ROOT, "tools", "run_net.py")

# The quickstart shrunk to one narrow block, so each epoch takes about a second; an AMP level a
# test asks for runs as asked (AMP.CPU_LEVEL same), not as this CPU's bfloat16 probe decides
TINY = [
    "AMP.CPU_LEVEL",
    "same",
    "VIT.DEPTH",
    "1",
    "VIT.WIDTH",
    "32",
    "VIT.NUM_HEADS",
    "2",
    "VIT.MLP_DIM",
    "64",
    "TRAIN.BATCH_SIZE",
    "64",
    "LOG_PERIOD",
    "5",
]


def tiny_quickstart(out_dir, *overrides):
    """The tiny quickstart config writing to ``out_dir``, with KEY VALUE overrides."""
    return config.load_cfg(QUICKSTART, [*TINY, "OUT_DIR", str(out_dir), *overrides])


def json_stats_of(out_dir, kind):
    """The json_stats lines of ``_type`` kind in OUT_DIR/stdout.log, in order."""
    stats = load_json_stats(os.path.join(str(out_dir), "stdout.log"))
    return [s for s in stats if s["_type"] == kind]


def resume_from(full_dir, resumed_dir, epoch, sharded=False):
    """A fresh OUT_DIR holding only the checkpoint ``full_dir`` wrote after ``epoch`` (a folder
    with ``sharded``): training there resumes as if the first run had been stopped at that point."""
    os.makedirs(checkpoint.get_checkpoint_dir(str(resumed_dir)))
    src, dst = (
        checkpoint.get_checkpoint_path(str(d), epoch, sharded=sharded)
        for d in (full_dir, resumed_dir)
    )
    (shutil.copytree if sharded else shutil.copy)(src, dst)


def tiny_vit():
    """A 2-block, 32-wide ViT on 16 px images, seeded: milliseconds per step."""
    torch.manual_seed(0)
    return VisionTransformer(
        image_size=16, patch_size=4, depth=2, width=32, num_heads=2, mlp_dim=64, num_classes=10
    )


def free_port():
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_tool(name, module_name=None, folder="tools"):
    """``tools/<name>.py`` (or ``benchmarks/<name>.py``) imported as a module (the scripts are not
    a package)."""
    path = os.path.join(ROOT, folder, f"{name}.py")
    spec = importlib.util.spec_from_file_location(module_name or name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StopRequested:
    """A preemption flag already raised (``Trainer.preemption``): the run checkpoints at its first
    sync point and raises ``pycls.distributed.Preempted``."""

    requested, interrupted = True, False


def busy_factor():
    """How many times slower than when idle this machine may run now: the larger of its 1- and
    5-minute load averages over the CPUs this process may use, at least 1. Every time limit of
    the tests is a hang guard, never a speed check: each is scaled by this (``scaled``)."""
    try:
        load = max(os.getloadavg()[:2])
    except (OSError, AttributeError):  # no load average on this system
        return 1.0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, load / (cpus or 1))


def scaled(seconds):
    """A time limit of ``seconds`` on an idle machine (10x its step's idle time or more), as
    long as the machine's load makes it now."""
    return seconds * busy_factor()


def within(seconds, fn):
    """What ``fn()`` returns or raises, failing the test if it takes longer than ``seconds``
    (give it ``scaled(...)``: a limit grows with the load) (run in a daemon thread: a reader
    blocked on a special file, in open() or a read, cannot hold the suite)."""
    outcome = []

    def run():
        try:
            outcome.append(fn())
        except BaseException as e:  # the outcome to check, whatever it is
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s (blocked on a special file?)"
    return outcome[0]
