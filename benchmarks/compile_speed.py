#!/usr/bin/env python3
"""torch.compile against eager execution: pycls's ViT compiled per block (TRAIN.COMPILE_SCOPE
blocks) and as a whole model (model), and timm's ViT eager and compiled, one training step each.

A step is forward, cross-entropy, backward and a fused AdamW step on synthetic images, in fp32
or (``--amp O1``) with the forward under bfloat16 autocast. Every
measurement runs in a fresh process pinned to ``--threads`` threads with an empty inductor cache
of its own (a cold compile, as on a new machine), and the contenders take turns
(pycls.core.timing.alternate): each runs once per round, the order shifting by one every round,
so a change in the machine's load falls on all of them alike. A process times its first step
(wall clock: compiling, whose worker processes ``process_time`` would not see), warms up, then
times ``--iters`` steps (CPU time at one thread, else wall time). The table holds each
contender's median step, the per-round medians, the ratio of its median to pycls eager's, the
median and quartiles of the per-round ratios, and the median first step. The load average is
printed before every round and its range is in the header.

    python benchmarks/compile_speed.py --arch vit_s16 --batch-size 8 --rounds 3 --out /tmp/compile
    python benchmarks/compile_speed.py --arch vit_s16 --batch-size 8 --amp O1 --rounds 3
    python benchmarks/compile_speed.py --tiny --rounds 1 --iters 2 --only pycls_eager pycls_blocks
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pycls.core import timing  # noqa: E402
from pycls.engines.base import compile_model  # noqa: E402
from pycls.models import VIT_SPECS, VisionTransformer  # noqa: E402

# name -> (library, compile scope or None, label); the reference comes first
CONTENDERS = {
    "pycls_eager": ("pycls", None, "pycls, eager"),
    "pycls_blocks": ("pycls", "blocks", "pycls, TRAIN.COMPILE_SCOPE blocks"),
    "pycls_model": ("pycls", "model", "pycls, TRAIN.COMPILE_SCOPE model"),
    "timm_eager": ("timm", None, "timm, eager"),
    "timm_model": ("timm", "model", "timm, torch.compile(model)"),
}
TIMM_NAMES = {"vit_ti16": "vit_tiny_patch16_224", "vit_s16": "vit_small_patch16_224",
              "vit_b16": "vit_base_patch16_224"}  # fmt: skip
TINY = dict(image_size=32, patch_size=8, depth=2, width=64, num_heads=2, mlp_dim=128)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="vit_s16", help="a pycls ViT size with a timm twin")
    p.add_argument("--tiny", action="store_true", help="a 2-block toy model (smoke runs)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--amp", choices=("O0", "O1"), default="O0",
                   help="O1: forward and loss under bfloat16 autocast")  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="turns each contender takes")
    p.add_argument("--iters", type=int, default=5, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--only", nargs="+", choices=sorted(CONTENDERS), help="these contenders")
    p.add_argument("--out", help="folder for compile.md and compile.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: one measurement, in this process
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ #
# The worker: one contender, one process
# ------------------------------------------------------------------------------------------------ #


def build_model(library, arch, tiny):
    """pycls's ViT (pooled classifier, batch-first: the recipes' settings) or timm's twin
    (class token, its default), 1000 classes."""
    torch.manual_seed(0)
    if library == "pycls":
        spec = TINY if tiny else {k: v for k, v in VIT_SPECS[arch].items() if k != "name"}
        return VisionTransformer(**spec, classifier="pooled", layout="batch_first")
    import timm  # optional: only the timm rows need it

    if tiny:
        return timm.models.VisionTransformer(
            img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0
        )
    return timm.create_model(TIMM_NAMES[arch], pretrained=False)


def run_worker(job):
    torch.set_num_threads(job["threads"])
    library, scope, _ = CONTENDERS[job["name"]]
    model = build_model(library, job["arch"], job["tiny"]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_model = model if scope is None else compile_model(model, scope)
    size = 32 if job["tiny"] else 224
    images = torch.randn(job["batch_size"], 3, size, size)
    labels = torch.randint(0, 1000 if not job["tiny"] else 10, (job["batch_size"],))

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=job["amp"] == "O1")

    def step():
        with autocast:
            loss = torch.nn.functional.cross_entropy(step_model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first = timing.time_calls(step).min  # wall clock: it includes the compiler's processes
    clock = time.process_time if job["threads"] == 1 else time.perf_counter
    steps = timing.time_calls(step, warmup=job["warmup"], iters=job["iters"], clock=clock)
    return {"first": first, "times": list(steps.times)}


def measure(job):
    """One worker process pinned to ``job['threads']`` threads, with a cache of its own."""
    with tempfile.TemporaryDirectory(prefix="pycls-inductor-") as cache:
        return timing.run_pinned(__file__, job, job["threads"], {"TORCHINDUCTOR_CACHE_DIR": cache})


# ------------------------------------------------------------------------------------------------ #
# The driver: rounds, table
# ------------------------------------------------------------------------------------------------ #


def contenders(args):
    names = args.only or list(CONTENDERS)
    if not args.only:
        try:
            import timm  # noqa: F401  (optional: the timm rows only where it is installed)
        except ImportError:
            names = [n for n in names if CONTENDERS[n][0] != "timm"]
    return names


def summarize(rounds, names):
    """Markdown lines: each contender's median step, spread, ratios to pycls eager, first step."""
    lines = [
        "| contender | median step, ms | per-round medians, ms | vs pycls eager "
        "| per-round ratios, median (quartiles) | first step, s |",
        "|---|---:|---|---:|---|---:|",
    ]
    ref = "pycls_eager" if "pycls_eager" in names else None
    for n in names:
        medians = ", ".join(f"{m * 1e3:.0f}" for m in rounds.round_medians(n))
        ratio, per_round = "n/a", "n/a"
        if ref:
            q = rounds.ratio(n, ref)
            ratio, per_round = f"{q.of_medians:.3f}x", f"{q.median:.3f} ({q.q1:.3f}-{q.q3:.3f})"
        first = statistics.median(result["first"] for result in rounds.results[n])
        lines.append(
            f"| {CONTENDERS[n][2]} | {rounds.timing(n).median * 1e3:.0f} | {medians} | {ratio} "
            f"| {per_round} | {first:.1f} |"
        )
    return lines


def job_of(args, name):
    """What one worker process measures."""
    keys = ("arch", "tiny", "batch_size", "amp", "threads", "warmup", "iters")
    return dict(name=name, **{k: getattr(args, k) for k in keys})


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    names = contenders(args)
    started = datetime.datetime.now(datetime.timezone.utc)
    rounds = timing.alternate(
        {n: partial(measure, job_of(args, n)) for n in names},
        args.rounds,
        log=partial(print, flush=True),
        describe=lambda r: f"first step {r['first']:.1f} s",
    )
    clock = "CPU time" if args.threads == 1 else "wall time"
    model = "tiny ViT" if args.tiny else args.arch
    precision = "fp32" if args.amp == "O0" else "bfloat16 autocast"
    header = (
        f"Date {started:%Y-%m-%d %H:%M} UTC, revision {timing.source_revision()}, "
        f"torch {torch.__version__}, {model}, batch {args.batch_size}, {precision}, "
        f"{args.threads} thread(s), "
        f"{args.rounds} rounds x {args.iters} steps per contender, steps in {clock}, first step "
        f"in wall time, load average (1 min) {rounds.load_range()}."
    )
    lines = [header, "", *summarize(rounds, names)]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compile.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "compile.json"), "w") as f:
            json.dump({"header": header, "results": rounds.results, "loads": rounds.loads}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
