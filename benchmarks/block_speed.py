#!/usr/bin/env python3
"""The ViT's block variants at equal FLOPs, on the CPU: forward + backward of one model (ViT-B/16
by default) with the sequential block, the parallel block (``VIT.BLOCK parallel``: attention and
MLP from one norm, their projections fused), bias-free layers (``VIT.QKV_BIAS False``,
``VIT.PROJ_BIAS False``) and both, in CPU time.

Every variant is built once in this process (the same seed; its FLOPs and parameters from
``vit_complexity``, which the tests hold to the built model), warmed up, then the variants take
turns (pycls.core.timing.alternate: one turn each per round, the order shifting every round), each
turn ``--iters`` steps of a fixed batch, timed with ``time.process_time`` on one intra-op thread:
CPU time hardly changes with what else the machine runs, wall time does. The table holds each
variant's median over every step, its ratio to the sequential block (pooled medians) and the
median and quartiles of the per-round ratios; the load average of every round is in the header.
The GPU measurement of the same levers is benchmarks/step_ab.py's (benchmarks/gpu_short.sh).

    python benchmarks/block_speed.py --arch vit_b16 --batch 2 --rounds 6 --iters 2
    python benchmarks/block_speed.py --tiny --rounds 1 --iters 1
"""

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pycls.core import timing  # noqa: E402
from pycls.models import VIT_SPECS, VisionTransformer, vit_complexity  # noqa: E402

# name -> the VitArgs each variant sets; the first is the reference
VARIANTS = {
    "sequential": {},
    "parallel": {"block": "parallel"},
    "bias_free": {"qkv_bias": False, "proj_bias": False},
    "parallel_bias_free": {"block": "parallel", "qkv_bias": False, "proj_bias": False},
}
# --tiny: a 2-block, 64-wide ViT at 32 px (a rehearsal: seconds)
TINY = dict(image_size=32, patch_size=8, depth=2, width=64, num_heads=2, mlp_dim=256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="vit_b16", choices=sorted(VIT_SPECS), help="model size")
    p.add_argument("--batch", type=int, default=2, help="images per step")
    p.add_argument("--rounds", type=int, default=6, help="turns each variant takes")
    p.add_argument("--iters", type=int, default=2, help="steps per turn, back to back")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these variants only")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a rehearsal)")
    p.add_argument("--out", help="folder for block_speed.md and block_speed.json")
    return p.parse_args(argv)


def sizes(args):
    if args.tiny:
        return dict(TINY)
    return dict(image_size=224, **VIT_SPECS[args.arch])


def build(args, overrides):
    """The model of a variant, with a step that runs forward + backward of a fixed batch."""
    torch.manual_seed(0)
    kwargs = {**sizes(args), "num_classes": 1000, "classifier": "token", **overrides}
    model = VisionTransformer(**kwargs).train()
    images = torch.randn(args.batch, 3, kwargs["image_size"], kwargs["image_size"])
    labels = torch.randint(0, 1000, (args.batch,))

    def step():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()

    cx = vit_complexity(model.args)
    return step, cx


def table(args, cx, rounds):
    names = list(rounds.results)
    ref = names[0]
    lines = [
        "| variant | GFLOPs / image | params (M) | fw+bw ms (median) | vs "
        f"{ref} | per round (median, q1-q3) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in names:
        t = rounds.timing(name)
        r = rounds.ratio(name, ref)
        lines.append(
            f"| {name} | {cx[name]['flops'] / 1e9:.3g} | {cx[name]['params'] / 1e6:.2f} | "
            f"{t.median * 1e3:.0f} | {r.of_medians:.3f} | {r.median:.3f} "
            f"({r.q1:.3f}-{r.q3:.3f}) |"
        )
    return lines


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    names = args.only or list(VARIANTS)
    steps, cx = {}, {}
    for name in names:
        steps[name], cx[name] = build(args, VARIANTS[name])
        for _ in range(args.warmup):
            steps[name]()
    cpu = time.process_time  # one thread: the process's CPU time is the step's
    rounds = timing.alternate(
        {
            n: (lambda n=n: timing.time_calls(steps[n], None, 0, args.iters, clock=cpu))
            for n in names
        },
        args.rounds,
        describe=lambda t: " ".join(f"{x * 1e3:.0f} ms" for x in t.times),
    )
    model = "tiny" if args.tiny else args.arch
    header = [
        f"{model}, batch {args.batch}, fp32 forward + backward, 1 thread, CPU time: "
        f"{args.rounds} rounds of {args.iters} steps per variant after {args.warmup} warm-up, "
        f"load {rounds.load_range()}, torch {torch.__version__}, pycls {timing.source_revision()}"
        f", {datetime.date.today().isoformat()}",
        "",
    ]
    lines = header + table(args, cx, rounds)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "block_speed.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        data = {n: {"times": rounds.times(n), "complexity": cx[n]} for n in names}
        data["loads"] = rounds.loads
        with open(os.path.join(args.out, "block_speed.json"), "w") as f:
            json.dump(data, f, indent=1)
    return rounds


if __name__ == "__main__":
    main()
