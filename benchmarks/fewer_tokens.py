#!/usr/bin/env python3
"""Fewer tokens, measured: what patch dropout, compute-skipping stochastic depth and packed
token batches save per training step, and what they cost in accuracy.

Speed tables (``--tables patch_drop drop_path packing``), for each ``--archs`` size at 224 px and
each ``--amps`` precision (O0: fp32; O1: bfloat16 autocast): one full training step as the
trainer runs it (pycls.core.benchmark.synthetic_training: the engine's forward and backward, the
fused optimizer step, the meter; a token budget's step on the token batch its sampler plans
first), timed per image, on synthetic images of ``--batch-size`` per step.

- patch_drop: every token, then keep 0.5 and 0.25 of them (VIT.PATCH_DROP 0.5, 0.75);
- drop_path: stochastic depth 0.1 as it is by default (VIT.DROP_PATH_MODE multiply: every branch
  computed, at any rate), then skip at 0.1, 0.3 and 0.5;
- packing: a token budget of ``--batch-size`` sequences of 14 x 14 patches, each image's side
  drawn between half and all of 224 px (TRAIN.TOKEN_MIN_SCALE 0.25), padded (one image per
  sequence) and packed (TRAIN.TOKEN_PACKING).

Each measurement runs in a fresh process pinned to ``--threads`` threads, the contenders of a
table taking turns (pycls.core.timing.alternate: the order shifting every round, so a change in
the machine's load falls on all alike); steps are timed in CPU time at one CPU thread, wall time
otherwise (on CUDA, ``--device cuda``, the device synchronised at both ends of each step;
``--compile`` compiles the blocks, where packed batches use FlexAttention's block masks). A
table gives each contender's images per step, tokens per image, GFLOPs per image
(multiply-adds, pycls.core.token_costs), median time per image, its speed-up over the table's
first contender (of the pooled medians, and the median and quartiles of the per-round ratios)
and the FLOP ratio it would have if time followed FLOPs.

Accuracy table (``--tables accuracy``): configs/quickstart.yaml trained by tools/run_net.py for
its 40 epochs with every token, with patch dropout (keep 0.5, 0.25, 0.75, and 0.5 or 0.75 with
the last epochs unmasked), with drop path 0.1 multiplied and skipped, and with a token budget
padded and packed (sizes 8, 12 and 16 px, sides varying 2x, aspect ratios up to 2; and milder,
12 and 16 px, sides varying 1.4x, aspect ratios up to 1.5); then each variant faster than the
full run again for the epochs that fill the full run's time. Every variant runs once per
``--seeds`` seed (a run of this small model can start slowly or not at all for one seed and
well for the next, so one run says little). Each run is a fresh process at one thread whose CPU
time (user + system) is its cost, so ``--jobs`` runs may share the machine; the table has each
variant's final test top-1 error (mean and each seed's), its mean CPU time and its speed-up per
epoch over the full run.

    python benchmarks/fewer_tokens.py --archs vit_s16 vit_b16 --amps O0 O1 --rounds 3 \\
        --out /tmp/fewer_tokens
    python benchmarks/fewer_tokens.py --tables accuracy --seeds 1 2 3 --jobs 2 \\
        --out /tmp/fewer_tokens
    python benchmarks/fewer_tokens.py --device cuda --archs vit_b16 --amps O1 --batch-size 128 \\
        --rounds 2 --iters 10 --warmup 5 --out /tmp/fewer_tokens_gpu  # the GPU campaign's
    python benchmarks/fewer_tokens.py --tiny --tables patch_drop packing --amps O0 --rounds 1 \\
        --iters 1 --warmup 0  # a smoke run
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pycls import config  # noqa: E402
from pycls.core import benchmark, timing, token_costs  # noqa: E402
from pycls.core.logging import load_json_stats  # noqa: E402
from pycls.models.vit.token_masks import TokenBatch, computed_tokens  # noqa: E402

SPEED_TABLES = {
    "patch_drop": {
        "all tokens": [],
        "keep 0.5": ["VIT.PATCH_DROP", "0.5"],
        "keep 0.25": ["VIT.PATCH_DROP", "0.75"],
    },
    "drop_path": {
        "drop path 0.1, multiply": ["VIT.DROP_PATH", "0.1"],
        "skip 0.1": ["VIT.DROP_PATH", "0.1", "VIT.DROP_PATH_MODE", "skip"],
        "skip 0.3": ["VIT.DROP_PATH", "0.3", "VIT.DROP_PATH_MODE", "skip"],
        "skip 0.5": ["VIT.DROP_PATH", "0.5", "VIT.DROP_PATH_MODE", "skip"],
    },
    "packing": {
        "padded": ["TRAIN.TOKEN_MIN_SCALE", "0.25"],
        "packed": ["TRAIN.TOKEN_MIN_SCALE", "0.25", "TRAIN.TOKEN_PACKING", "True"],
    },
}
# The quickstart's variants: (label, overrides)
_TOKENS = [
    "TRAIN.TOKEN_BUDGET",
    "512",
    "TRAIN.TOKEN_SIZES",
    "[8, 12, 16]",
    "TRAIN.TOKEN_MIN_SCALE",
    "0.25",
    "TRAIN.TOKEN_MAX_ASPECT",
    "2.0",
]
# Milder: caps of 12 and 16 px, sides varying 1.4x, aspect ratios up to 1.5
_MILD_TOKENS = ["TRAIN.TOKEN_BUDGET", "512", "TRAIN.TOKEN_SIZES", "[12, 16]",
                "TRAIN.TOKEN_MIN_SCALE", "0.5", "TRAIN.TOKEN_MAX_ASPECT", "1.5"]  # fmt: skip
ACCURACY = {
    "all tokens": [],
    "keep 0.5": ["VIT.PATCH_DROP", "0.5"],
    "keep 0.25": ["VIT.PATCH_DROP", "0.75"],
    "keep 0.5, last 4 epochs all": ["VIT.PATCH_DROP", "0.5", "VIT.PATCH_DROP_OFF_EPOCH", "36"],
    "keep 0.75": ["VIT.PATCH_DROP", "0.25"],
    "keep 0.75, last 10 epochs all": ["VIT.PATCH_DROP", "0.25", "VIT.PATCH_DROP_OFF_EPOCH", "30"],
    "drop path 0.1, multiply": ["VIT.DROP_PATH", "0.1"],
    "drop path 0.1, skip": ["VIT.DROP_PATH", "0.1", "VIT.DROP_PATH_MODE", "skip"],
    "token budget, padded": _TOKENS,
    "token budget, packed": [*_TOKENS, "TRAIN.TOKEN_PACKING", "True"],
    "token budget 12-16 px, padded": _MILD_TOKENS,
    "token budget 12-16 px, packed": [*_MILD_TOKENS, "TRAIN.TOKEN_PACKING", "True"],
}
QUICKSTART_EPOCHS = 40
TINY = [
    "MODEL.ARCH",
    "",
    "VIT.PATCH_SIZE",
    "8",
    "VIT.DEPTH",
    "2",
    "VIT.WIDTH",
    "64",
    "VIT.NUM_HEADS",
    "2",
    "VIT.MLP_DIM",
    "128",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tables", nargs="+", default=list(SPEED_TABLES), choices=[*SPEED_TABLES, "accuracy"]
    )
    p.add_argument("--archs", nargs="+", default=["vit_s16", "vit_b16"])
    p.add_argument(
        "--amps",
        nargs="+",
        default=["O0", "O1"],
        choices=("O0", "O1"),
        help="O1: bfloat16 autocast",
    )
    p.add_argument("--tiny", action="store_true", help="a 2-block toy ViT at 32 px (smoke runs)")
    p.add_argument("--batch-size", type=int, default=8, help="images (or sequences) per step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compile", action="store_true", help="TRAIN.COMPILE (regional)")
    p.add_argument("--rounds", type=int, default=3, help="turns each contender takes")
    p.add_argument("--iters", type=int, default=2, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--epochs", type=int, default=QUICKSTART_EPOCHS, help="accuracy: epochs")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(ACCURACY),
        help="accuracy: only these (and all tokens, the reference)",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[1, 2, 3],
        help="accuracy: RNG_SEED of each run (every variant runs each seed; the table averages)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="accuracy: runs at once (CPU time is what is compared, so they may share the machine)",
    )
    p.add_argument("--out", help="folder for fewer_tokens.md and fewer_tokens.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: one measurement, in this process
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ #
# The worker: one contender's training step, one process
# ------------------------------------------------------------------------------------------------ #


def step_config(job):
    size = 32 if job["tiny"] else 224
    arch = TINY if job["tiny"] else ["MODEL.ARCH", job["arch"]]
    overrides = [
        *arch,
        "MODEL.NUM_CLASSES",
        "1000",
        "VIT.CLASSIFIER",
        "pooled",
        "VIT.LAYOUT",
        "batch_first",
        "TRAIN.DATASET",
        "synthetic",
        "TEST.DATASET",
        "synthetic",
        "DEVICE",
        job["device"],
        "TRAIN.COMPILE",
        str(job["compile"]),
        "TRAIN.IM_SIZE",
        str(size),
        "TEST.IM_SIZE",
        str(size),
        "TRAIN.BATCH_SIZE",
        str(job["batch_size"]),
        "AMP.LEVEL",
        job["amp"],
        "AMP.DTYPE",
        "bfloat16",
        "AMP.CPU_LEVEL",
        "same",
        "OPTIM.CONTIGUOUS_PARAMS",
        "True",
        "DATA_LOADER.NUM_WORKERS",
        "0",
        "OUT_DIR",
        job["out_dir"],
    ]
    if job["table"] == "packing":
        patches = (size // (8 if job["tiny"] else 16)) ** 2
        overrides += ["TRAIN.TOKEN_BUDGET", str(job["batch_size"] * patches)]
    return config.load_cfg(None, [*overrides, *job["overrides"]])


def run_worker(job):
    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    cfg = step_config(job)
    device = torch.device(job["device"])
    _, run, parts = benchmark.synthetic_training(cfg, device)
    engine, *_, (images, labels) = parts
    engine.compile()
    model = engine.module
    n = labels.numel()
    tokens = computed_tokens(model, images) / n
    flops = token_costs.flops_per_image(model, images, cfg.TRAIN.IM_SIZE, training=True)
    cpu_time = job["threads"] == 1 and device.type == "cpu"
    clock = time.process_time if cpu_time else time.perf_counter
    steps = timing.time_calls(run, device, job["warmup"], job["iters"], clock=clock)
    return {
        "times": [t / n for t in steps.times],  # seconds per image
        "images": n,
        "tokens_per_image": tokens,
        "gflops_per_image": flops / 1e9,
        "packed": isinstance(images, TokenBatch) and images.packed,
    }


def measure(job):
    with tempfile.TemporaryDirectory(prefix="pycls-fewer-tokens-") as out:
        return timing.run_pinned(__file__, {**job, "out_dir": out}, job["threads"])


# ------------------------------------------------------------------------------------------------ #
# Speed tables
# ------------------------------------------------------------------------------------------------ #


def speed_table(args, table, arch, amp):
    contenders = SPEED_TABLES[table]
    jobs = {
        name: dict(
            table=table,
            arch=arch,
            amp=amp,
            overrides=overrides,
            tiny=args.tiny,
            batch_size=args.batch_size,
            threads=args.threads,
            warmup=args.warmup,
            iters=args.iters,
            device=args.device,
            compile=args.compile,
        )
        for name, overrides in contenders.items()
    }
    print(f"## {table}: {'tiny ViT' if args.tiny else arch}, {amp}", flush=True)
    rounds = timing.alternate(
        {name: partial(measure, job) for name, job in jobs.items()},
        args.rounds,
        log=partial(print, flush=True),
        describe=lambda r: f"{statistics.median(r['times']) * 1e3:.1f} ms per image",
    )
    ref = next(iter(contenders))
    first = rounds.results[ref][0]
    lines = [
        "| contender | images / step | tokens / image | GFLOPs / image | ms / image (median) "
        "| speed-up (pooled) | per-round speed-ups, median (quartiles) | FLOP ratio |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name in contenders:
        info = rounds.results[name][0]
        q = rounds.ratio(ref, name)  # the reference's time over this one's: a speed-up
        lines.append(
            f"| {name} | {info['images']} | {info['tokens_per_image']:.1f} "
            f"| {info['gflops_per_image']:.3g} | {rounds.timing(name).median * 1e3:.1f} "
            f"| {q.of_medians:.2f}x | {q.median:.2f} ({q.q1:.2f}-{q.q3:.2f}) "
            f"| {first['gflops_per_image'] / info['gflops_per_image']:.2f}x |"
        )
    return rounds, lines


# ------------------------------------------------------------------------------------------------ #
# Accuracy on the quickstart
# ------------------------------------------------------------------------------------------------ #


def start_quickstart(overrides, epochs, tiny, out):
    """tools/run_net.py training the quickstart into ``out``, in a fresh process pinned to one
    thread (its output in out.log); returns the Popen."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "run_net.py"),
        "--mode",
        "train",
        "--cfg",
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        "OUT_DIR",
        out,
        "OPTIM.MAX_EPOCH",
        str(epochs),
        "TRAIN.EVAL_PERIOD",
        str(epochs),
        "DEVICE",
        "cpu",
        *overrides,
    ]
    if tiny:
        cmd += ["VIT.DEPTH", "1", "VIT.WIDTH", "32", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64"]
    log = open(out + ".log", "w")  # noqa: SIM115 (closed when the process is collected)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=timing.pinned_env(1)
    )
    proc.log = log
    return proc


def collect_quickstart(proc, out, epochs):
    """Waits for a quickstart run: its final test top-1 error, its CPU time (user + system, of
    the whole process at one thread: what the run costs, whatever else loads the machine) and
    its tokens per image."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.log.close()
    if status != 0:
        with open(out + ".log") as f:
            raise RuntimeError(f"the quickstart in {out} failed:\n{f.read()[-3000:]}")
    stats = load_json_stats(os.path.join(out, "stdout.log"))
    train = [s for s in stats if s["_type"] == "train_epoch"]
    test = [s for s in stats if s["_type"] == "test_epoch"][-1]
    return {
        "times": [usage.ru_utime + usage.ru_stime],
        "top1_err": test["top1_err"],
        "epochs": epochs,
        "tokens_per_image": statistics.mean(s.get("tokens_per_image", 0) for s in train),
    }


def train_quickstarts(runs, tiny, jobs):
    """{(name, seed): result} of the quickstart runs {(name, seed): (overrides, epochs)}, ``jobs``
    at a time."""
    results, pending = {}, list(runs.items())
    with tempfile.TemporaryDirectory(prefix="pycls-fewer-tokens-") as root:
        running = []
        while pending or running:
            while pending and len(running) < jobs:
                (name, seed), (overrides, epochs) = pending.pop(0)
                out = os.path.join(root, f"run{len(runs) - len(pending)}")
                print(
                    f"  {name}, seed {seed}: {epochs} epochs "
                    f"(load average {timing.load_average()})",
                    flush=True,
                )
                overrides = [*overrides, "RNG_SEED", str(seed)]
                proc = start_quickstart(overrides, epochs, tiny, out)
                running.append(((name, seed), out, epochs, proc))
            key, out, epochs, proc = running.pop(0)
            results[key] = r = collect_quickstart(proc, out, epochs)
            print(
                f"  {key[0]}, seed {key[1]}: {r['top1_err']:.2f} % in {r['times'][0]:.0f} CPU s",
                flush=True,
            )
    return results


def over_seeds(results, name, seeds):
    """One variant's runs over ``seeds``: mean error and CPU time, the error of each seed."""
    runs = [results[(name, seed)] for seed in seeds]
    return {
        "epochs": runs[0]["epochs"],
        "tokens_per_image": statistics.mean(r["tokens_per_image"] for r in runs),
        "top1_err": statistics.mean(r["top1_err"] for r in runs),
        "top1_errs": [r["top1_err"] for r in runs],
        "time": statistics.mean(r["times"][0] for r in runs),
    }


def accuracy_table(args):
    """The quickstart's variants at its epochs, each over ``--seeds``, then each faster one for
    the epochs that fill the full run's CPU time (its mean over the seeds)."""
    print("## accuracy: the quickstart", flush=True)
    epochs = 2 if args.tiny else args.epochs
    seeds = args.seeds
    loads = [timing.load_average()]
    names = ["all tokens", *[v for v in args.variants or ACCURACY if v != "all tokens"]]
    runs = {(n, s): (ACCURACY[n], epochs) for n in names for s in seeds}
    results = train_quickstarts(runs, args.tiny, args.jobs)
    rows = {name: over_seeds(results, name, seeds) for name in names}
    base = rows["all tokens"]
    more = {}
    for name, row in rows.items():
        speedup = base["time"] / row["time"]
        if name != "all tokens" and speedup > 1.05:
            more[f"{name}, equal time"] = (ACCURACY[name], round(epochs * speedup))
    loads.append(timing.load_average())
    runs = {(n, s): more[n] for n in more for s in seeds}
    results.update(train_quickstarts(runs, args.tiny, args.jobs))
    rows.update({name: over_seeds(results, name, seeds) for name in more})
    loads.append(timing.load_average())
    lines = [
        f"Seeds {', '.join(map(str, seeds))} (RNG_SEED) per variant: the error and CPU time are "
        "their means, each seed's error follows.",
        "",
        "| variant | epochs | tokens / image | test top-1 error, % | each seed | "
        "vs all tokens, points | CPU time, s | speed-up per epoch |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, row in rows.items():
        per_epoch = base["time"] / epochs / (row["time"] / row["epochs"])
        each = " / ".join(f"{e:.1f}" for e in row["top1_errs"])
        lines.append(
            f"| {name} | {row['epochs']} | {row['tokens_per_image']:.1f} | {row['top1_err']:.2f} "
            f"| {each} | {row['top1_err'] - base['top1_err']:+.2f} | {row['time']:.0f} "
            f"| {per_epoch:.2f}x |"
        )
    dump = {f"{name}/seed {seed}": r for (name, seed), r in results.items()}
    return loads, lines, dump


def device_name(device):
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{os.cpu_count()} CPU(s)"


def write(args, started, text, dump, loads):
    """The header and the tables so far, printed and written to ``--out`` (after every table: a
    run stopped at a time limit keeps what it measured)."""
    clock = "CPU time" if args.threads == 1 and args.device == "cpu" else "wall time"
    known = [x for x in loads if x is not None]
    load = f"{min(known):.2f}-{max(known):.2f}" if known else "unknown"
    header = (
        f"Date {started:%Y-%m-%d %H:%M} UTC, revision {timing.source_revision()}, torch "
        f"{torch.__version__}, {device_name(args.device)}, {args.threads} thread(s) per process, "
        f"{'compiled blocks' if args.compile else 'eager'}, "
        f"batch {args.batch_size}, {args.rounds} rounds x {args.iters} steps per contender (after "
        f"{args.warmup} untimed), steps in {clock}, load average (1 min) {load}."
    )
    if not args.out:
        return header
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fewer_tokens.md"), "w") as f:
        f.write("\n".join([header, "", *text]) + "\n")
    with open(os.path.join(args.out, "fewer_tokens.json"), "w") as f:
        json.dump({"header": header, "results": dump, "loads": loads}, f, indent=1)
    return header


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    text, dump, loads = [], {}, []
    for table in args.tables:
        if table == "accuracy":
            accuracy_loads, lines, results = accuracy_table(args)
            loads += accuracy_loads
            text += ["### accuracy: configs/quickstart.yaml", "", *lines, ""]
            dump["accuracy"] = results
            write(args, started, text, dump, loads)
            continue
        for arch in ["tiny"] if args.tiny else args.archs:
            for amp in args.amps:
                rounds, lines = speed_table(args, table, arch, amp)
                loads += rounds.loads
                precision = "fp32" if amp == "O0" else "bfloat16 autocast"
                text += [f"### {table}: {arch}, {precision}", "", *lines, ""]
                dump[f"{table}/{arch}/{amp}"] = rounds.results
                print("\n".join(lines), flush=True)
                write(args, started, text, dump, loads)
    print("\n".join([write(args, started, text, dump, loads), "", *text]))


if __name__ == "__main__":
    main()
