#!/usr/bin/env python3
"""Time one optimizer step of pycls's SGD, AdamW, LAMB and Muon against torch.optim's fused ones,
and other libraries' optimizers as OPTIM.OPTIMIZER builds them (schedulefree_adamw, timm:NAME)
beside torch's fused AdamW.

Each contender steps over the parameters of one model (ViT-B/16 by default: 86.6 M parameters in
152 tensors, in pycls's two weight-decay groups; Muon takes the 48 matrices of the blocks out of
the decay group) with fixed random gradients. Every measurement
runs in a fresh process pinned to a thread count (``torch.set_num_threads`` and OMP/MKL variables),
and the contenders take turns (pycls.core.timing.alternate): each contender at each thread count
runs once per round, the order shifting by one every round, so a change in the machine's load
falls on all of them alike. A process warms up, then times ``--iters`` steps; the table holds the
median over all timed steps of all rounds, the per-round medians, the ratio of that median to the
reference's (torch's fused AdamW for AdamW and LAMB, torch's fused SGD for SGD) and the median and
quartiles of the per-round ratios. The load average is printed before every round and its range
is in the header.

``--plot`` draws each contender's per-round ratios to its reference into OUT/optimizer.png.

``--baseline-rev REV`` adds pycls's optimizers as they were at git revision REV (loaded from
``git show``) as more contenders: before and after in one run.

    python benchmarks/optimizer_step.py --threads 1 2 --rounds 3 --out /tmp/opt
    python benchmarks/optimizer_step.py --tiny --rounds 1 --iters 2 --only pycls_adamw pycls_sgd
    python benchmarks/optimizer_step.py --threads 1 --clock process --only torch_fused_adamw \
        schedulefree_adamw timm:lion timm:laprop --plot --out /tmp/opt_library
"""

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pycls.core import timing  # noqa: E402
from pycls.models import VIT_SPECS, VisionTransformer  # noqa: E402
from pycls.optim import library_optimizers, param_groups  # noqa: E402
from pycls.optim import optimizers as pycls_optimizer  # noqa: E402

WEIGHT_DECAY = 0.05
# name -> (family, what builds it); the reference of each family comes first
CONTENDERS = {
    "torch_fused_adamw": ("adamw", "torch.optim.AdamW(fused=True)"),
    "torch_foreach_adamw": ("adamw", "torch.optim.AdamW(foreach=True)"),
    "pycls_adamw": ("adamw", "pycls AdamW"),
    "pycls_adamw_contiguous": ("adamw", "pycls AdamW(contiguous=True)"),
    "torch_fused_sgd": ("sgd", "torch.optim.SGD(fused=True), momentum 0.9"),
    "torch_foreach_sgd": ("sgd", "torch.optim.SGD(foreach=True), momentum 0.9"),
    "pycls_sgd": ("sgd", "pycls SGD, momentum 0.9"),
    "pycls_sgd_contiguous": ("sgd", "pycls SGD(contiguous=True), momentum 0.9"),
    "pycls_lamb": ("lamb", "pycls LAMB"),
    "pycls_lamb_contiguous": ("lamb", "pycls LAMB(contiguous=True)"),
    "timm_lamb": ("lamb", "timm.optim.Lamb (foreach, no clipping)"),
    "pycls_muon": ("muon", "pycls Muon (blocks' matrices) + AdamW (the rest)"),
    "torch_muon": ("muon", "torch.optim.Muon (blocks' matrices) + fused AdamW (the rest)"),
    "schedulefree_adamw": ("library", "Schedule-Free AdamW (schedulefree, foreach)"),
}
# timm's registry by name, as OPTIM.OPTIMIZER timm:NAME builds them (timm's defaults: foreach
# where the optimizer has it)
TIMM_CONTENDERS = ("lion", "laprop", "mars", "adopt", "nadamw", "adan")
CONTENDERS.update({f"timm:{n}": ("library", f"timm:{n}") for n in TIMM_CONTENDERS})
REFERENCE = {"adamw": "torch_fused_adamw", "sgd": "torch_fused_sgd", "lamb": "torch_fused_adamw"}
REFERENCE["muon"] = REFERENCE["library"] = "torch_fused_adamw"
BASELINE = ("pycls_adamw", "pycls_sgd", "pycls_lamb")  # also timed at --baseline-rev


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="vit_b16", help="a pycls ViT size (pycls.models.VIT_SPECS)")
    p.add_argument("--tiny", action="store_true", help="a 2-block toy model (smoke runs)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3, help="turns each contender takes")
    p.add_argument("--iters", type=int, default=5, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per process")
    p.add_argument("--only", nargs="+", choices=sorted(CONTENDERS), help="these contenders")
    p.add_argument("--baseline-rev", help="also time pycls's optimizers at this git revision")
    p.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall: elapsed time; process: this process's CPU time (time.process_time), which a "
        "busy machine's preemption does not inflate; it adds up the threads, so use it at 1 thread",
    )
    p.add_argument("--out", help="folder for optimizer.md and optimizer.json")
    p.add_argument("--plot", action="store_true", help="also OUT/optimizer.png (needs --out)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: one measurement, in this process
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ #
# The worker: one contender, one thread count, one process
# ------------------------------------------------------------------------------------------------ #


# Where the optimizers' source lived, newest first (pycls/core/optimizer.py is now a shim)
OPTIMIZER_PATHS = ("pycls/optim/optimizers.py", "pycls/core/optimizer.py")


def _pycls_module(rev):
    """pycls.optim.optimizers now, or the optimizers' module as it was at git revision ``rev``
    (its own imports of pycls resolve to this checkout)."""
    if rev is None:
        return pycls_optimizer
    for where in OPTIMIZER_PATHS:
        show = ["git", "-C", ROOT, "show", f"{rev}:{where}"]
        proc = subprocess.run(show, capture_output=True, text=True)
        if proc.returncode == 0:
            source = proc.stdout
            break
    else:
        raise SystemExit(f"--baseline-rev {rev}: none of {OPTIMIZER_PATHS} exists at that revision")
    path = os.path.join(tempfile.mkdtemp(), "optimizer_at_rev.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("optimizer_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Both:
    """torch.optim.Muon over the Muon groups and torch's fused AdamW over the others, stepped
    together: what a torch-only training loop runs."""

    def __init__(self, groups, adam):
        muon = [g for g in groups if g.get("use_muon")]
        rest = [{k: v for k, v in g.items() if k != "use_muon"} for g in groups if g not in muon]
        muon = [{k: v for k, v in g.items() if k not in ("use_muon", "lr_scale")} for g in muon]
        self.parts = [torch.optim.Muon(muon, lr=adam["lr"], adjust_lr_fn="match_rms_adamw"),
                      torch.optim.AdamW(rest, **adam, fused=True)]  # fmt: skip

    def step(self):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none=True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def build_optimizer(name, groups, rev=None):
    adam = dict(lr=1e-4, betas=(0.9, 0.999))
    sgd = dict(lr=1e-2, momentum=0.9)
    if name == "torch_muon":
        return _Both(groups, adam)
    if name == "pycls_muon":
        return pycls_optimizer.Muon(groups, **adam)
    if name.startswith("torch_"):
        kind = "fused" if "_fused_" in name else "foreach"
        cls = torch.optim.AdamW if name.endswith("adamw") else torch.optim.SGD
        return cls(groups, **(adam if cls is torch.optim.AdamW else sgd), **{kind: True})
    if name == "schedulefree_adamw":
        return library_optimizers.schedule_free_adamw(groups, eps=1e-8, weight_decay=0.05, **adam)
    if name.startswith("timm:"):
        return library_optimizers.timm_optimizer(
            groups, name[5:], momentum=0.9, eps=1e-8, weight_decay=0.05, **adam
        )
    if name == "timm_lamb":
        from timm.optim import Lamb  # optional: only this contender needs timm

        return Lamb(groups, max_grad_norm=None, **adam)
    ours = _pycls_module(rev)
    contiguous = name.endswith("_contiguous")
    kwargs = dict(contiguous=contiguous) if contiguous else {}
    if name.startswith("pycls_adamw"):
        return ours.AdamW(groups, **adam, **kwargs)
    if name.startswith("pycls_sgd"):
        return ours.SGD(groups, **sgd, **kwargs)
    return ours.LAMB(groups, **adam, **kwargs)


def build_model(arch, tiny):
    torch.manual_seed(0)
    spec = dict(image_size=224, num_classes=1000, **VIT_SPECS.get(arch, {}))
    if tiny:
        spec = dict(image_size=32, num_classes=10, patch_size=8, depth=2, width=64)
        spec.update(num_heads=2, mlp_dim=128)
    with torch.device("meta"):  # only the shapes matter: skip the model's own initialisation
        model = VisionTransformer(**spec)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02)
    return model


def run_worker(job):
    """Times ``job['iters']`` steps after ``job['warmup']``; returns seconds per step."""
    torch.set_num_threads(job["threads"])
    model = build_model(job["arch"], job["tiny"])
    muon = CONTENDERS[job["name"]][0] == "muon"
    groups = param_groups(model, WEIGHT_DECAY, muon_weight_decay=WEIGHT_DECAY if muon else None)
    opt = build_optimizer(job["name"], groups, job.get("rev"))
    opt.zero_grad(set_to_none=False)  # contiguous mode: the gradients are views of its buffer
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    clock = time.process_time if job.get("clock") == "process" else time.perf_counter
    steps = timing.time_calls(opt.step, None, job["warmup"], job["iters"], clock=clock)
    return {
        "times": list(steps.times),
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": sum(1 for _ in model.parameters()),
    }


def measure(job):
    """One worker process pinned to ``job['threads']`` threads."""
    return timing.run_pinned(__file__, job, job["threads"])


# ------------------------------------------------------------------------------------------------ #
# The driver: rounds, table
# ------------------------------------------------------------------------------------------------ #


def contenders(args):
    """(key, name, rev) in run order."""
    names = args.only or list(CONTENDERS)
    if not args.only:
        names = [n for n in names if _installed(n)]
    rows = [(n, n, None) for n in names]
    if args.baseline_rev:
        rows += [(f"{n}@{args.baseline_rev}", n, args.baseline_rev) for n in BASELINE if n in names]
    return rows


def _installed(name):
    """Whether the package a contender needs is here (timm, schedulefree: optional)."""
    packages = {"timm": "timm", "schedulefree": "schedulefree"}
    needed = [p for key, p in packages.items() if key in name]
    return all(importlib.util.find_spec(p) is not None for p in needed)


def contender_id(key, threads):
    return f"{key}|{threads}"


def summarize(rounds, rows, threads):
    """Markdown lines: per thread count, each contender's median, spread and ratios."""
    lines = [
        "| threads | optimizer | median ms | per-round medians, ms | vs reference "
        "| per-round ratios, median (quartiles) |",
        "|---:|---|---:|---|---:|---|",
    ]
    for t in threads:
        for key, name, rev in rows:
            this, ref = contender_id(key, t), REFERENCE[CONTENDERS[name][0]]
            ratio = rounds.ratio(this, contender_id(ref, t))
            medians = ", ".join(f"{m * 1e3:.1f}" for m in rounds.round_medians(this))
            label = CONTENDERS[name][1] + (f" at {rev}" if rev else "")
            lines.append(
                f"| {t} | {label} | {rounds.timing(this).median * 1e3:.1f} | {medians} "
                f"| {ratio.of_medians:.2f}x {REFERENCE_LABEL[ref]} "
                f"| {ratio.median:.2f} ({ratio.q1:.2f}-{ratio.q3:.2f}) |"
            )
    return lines


REFERENCE_LABEL = {"torch_fused_adamw": "fused AdamW", "torch_fused_sgd": "fused SGD"}


def plot(rounds, rows, threads, path, title):
    """Each contender's per-round ratios to its reference (points) and their median (bar), one
    panel per thread count."""
    import matplotlib  # optional: only --plot draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: only --plot draws

    fig, axes = plt.subplots(1, len(threads), figsize=(7 * len(threads), 0.45 * len(rows) + 1.5),
                             squeeze=False)  # fmt: skip
    for ax, t in zip(axes[0], threads):
        labels, medians = [], []
        for i, (key, name, rev) in enumerate(rows):
            ref = contender_id(REFERENCE[CONTENDERS[name][0]], t)
            ratios = rounds.ratio(contender_id(key, t), ref).per_round
            labels.append(CONTENDERS[name][1] + (f" at {rev}" if rev else ""))
            medians.append(rounds.ratio(contender_id(key, t), ref).of_medians)
            ax.plot(ratios, [i] * len(ratios), "k.", markersize=4)
        ax.barh(range(len(rows)), medians, color="tab:blue", alpha=0.6)
        ax.axvline(1.0, color="gray", linewidth=0.8)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"step time / its reference's ({t} thread{'s' * (t > 1)})")
    fig.suptitle(textwrap.fill(title, 110), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    rows = contenders(args)
    refs = {REFERENCE[CONTENDERS[name][0]] for _, name, _ in rows}
    missing = refs - {key for key, _, _ in rows}
    rows += [(n, n, None) for n in sorted(missing)]  # the ratios need their references
    jobs = {}
    for t in args.threads:
        for key, name, rev in rows:
            job = dict(name=name, rev=rev, threads=t, arch=args.arch, tiny=args.tiny)
            jobs[contender_id(key, t)] = dict(job, iters=args.iters, warmup=args.warmup,
                                              clock=args.clock)  # fmt: skip
    started = datetime.datetime.now(datetime.timezone.utc)
    rounds = timing.alternate(
        {cid: partial(measure, job) for cid, job in jobs.items()},
        args.rounds,
        log=partial(print, flush=True),
        describe=lambda out: f"{timing.Timing(tuple(out['times'])).median * 1e3:.1f} ms",
    )
    info = next(iter(rounds.results.values()))[0]
    header = [
        f"Date {started:%Y-%m-%d %H:%M} UTC, revision {timing.source_revision()}, torch "
        f"{torch.__version__}, {'tiny model' if args.tiny else args.arch} "
        f"({info['params'] / 1e6:.1f} M parameters, {info['tensors']} tensors), "
        f"{args.rounds} rounds x {args.iters} steps per contender and thread count, "
        f"{'CPU' if args.clock == 'process' else 'wall'} time, load average "
        f"(1 min) {rounds.load_range()}.",
        "Command: `python benchmarks/optimizer_step.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "",
    ]
    table = header + summarize(rounds, rows, args.threads)
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "optimizer.md"), "w") as f:
            f.write("\n".join(table) + "\n")
        with open(os.path.join(args.out, "optimizer.json"), "w") as f:
            json.dump({cid: rounds.times(cid) for cid in rounds.results}, f)
        if args.plot:
            title = header[0].split(", load")[0]
            plot(rounds, rows, args.threads, os.path.join(args.out, "optimizer.png"), title)


if __name__ == "__main__":
    main()
