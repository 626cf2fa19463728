#!/usr/bin/env python3
"""Regenerates the quickstart accuracy figures that docs/reproducibility.md quotes.

Trains configs/quickstart.yaml (the bundled digits, no download) once per setting: in one process
with 1 and 2 intra-op threads, under torchrun with 2 processes for each engine (ddp, fsdp), and
from prepared shards; repeats the first setting to check that a run is repeatable; with
``--seeds``, every setting once per RNG_SEED (the spread a user sees who changes the seed); with
``--variant NAME "KEY VALUE ..."`` (repeatable), every setting and seed once per model or recipe
variant (the first is the reference). Prints a markdown table of the final test top-1 error, wall
time and the machine's load average (other processes slow the runs down, they do not change their
numbers), and the range of the errors, per variant its mean and range; ``--plot FILE`` draws each
variant's runs beside its mean.

    python benchmarks/readme_numbers.py                  # the full 40 epochs: 10-20 min on 2 cores
    python benchmarks/readme_numbers.py --epochs 10 --settings none:1 ddp:1 --out /tmp/rn
    python benchmarks/readme_numbers.py --settings none:1 --seeds 1 2 3 4 5 6 7 8 --repeat 0
    python benchmarks/readme_numbers.py --settings none:1 --seeds 1 2 3 --repeat 0 \\
        --variant today "" --variant qk_norm "VIT.QK_NORM layer" --plot /tmp/rn/variants.png

Every run writes to OUT/<setting>; the table goes to stdout and OUT/readme_numbers.md.
"""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pycls.core import timing  # noqa: E402
from pycls.core.logging import load_json_stats  # noqa: E402

RUN_NET = os.path.join(ROOT, "tools", "run_net.py")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
# engine:threads; "shards" is the one-process run reading prepared shards
SETTINGS = ("none:1", "none:2", "ddp:1", "fsdp:1", "shards:2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=40, help="OPTIM.MAX_EPOCH of every run")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=SETTINGS,
        help="ENGINE:THREADS (ENGINE: none, ddp, "
        "fsdp, pipeline or shards; THREADS: intra-op threads per process)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="extra runs of the first setting")
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        help="RNG_SEED of each run: every setting runs once per seed (default: the config's)",
    )
    parser.add_argument(
        "--variant",
        nargs=2,
        action="append",
        metavar=("NAME", "OPTS"),
        help='a variant: its name and its "KEY VALUE ..." overrides (default: the config as it is)',
    )
    parser.add_argument("--plot", help="a PNG of each variant's errors (with --variant)")
    parser.add_argument("--out", default="/tmp/pycls_readme_numbers", help="output folder")
    args = parser.parse_args(argv)
    args.variant = args.variant or [("quickstart", "")]
    return args


def command(engine, out_dir, epochs, shards, seed=None, overrides=()):
    cmd = [sys.executable, RUN_NET]
    if engine in ("ddp", "fsdp", "pipeline"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", RUN_NET]
    cmd += ["--mode", "train", "--cfg", QUICKSTART, "OUT_DIR", out_dir]
    cmd += ["OPTIM.MAX_EPOCH", str(epochs), "TRAIN.AUTO_RESUME", "False"]
    if seed is not None:
        cmd += ["RNG_SEED", str(seed)]
    if engine in ("ddp", "fsdp", "pipeline"):
        cmd += ["TRAIN.PARALLEL", engine]
    if engine == "shards":
        cmd += ["DATA_LOADER.BACKEND", "shards", "DATA_LOADER.SHARD_PATH", shards]
    return cmd + list(overrides)


def last_test_epoch(out_dir):
    tests = [
        s
        for s in load_json_stats(os.path.join(out_dir, "stdout.log"))
        if s.get("_type") == "test_epoch"
    ]
    return tests[-1] if tests else None


def run_setting(setting, out_dir, epochs, shards, seed=None, variant=("quickstart", "")):
    engine, threads = setting.split(":")
    env = timing.pinned_env(threads)
    runs = []

    def train():
        cmd = command(engine, out_dir, epochs, shards, seed, shlex.split(variant[1]))
        runs.append(subprocess.run(cmd, env=env, capture_output=True, text=True))

    loads = [timing.load_average()]
    seconds = timing.time_calls(train).min
    loads.append(timing.load_average())
    proc = runs[0]
    if proc.returncode != 0:
        raise SystemExit(f"{setting} failed:\n{proc.stderr[-3000:]}")
    stats = last_test_epoch(out_dir)
    return {
        "variant": variant[0],
        "setting": setting,
        "seed": seed,
        "top1_err": stats["top1_err"],
        "num_samples": stats["num_samples"],
        "seconds": seconds,
        "load": None if None in loads else sum(loads) / 2,
    }


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    shards = os.path.join(args.out, "digits_shards")
    if any(s.startswith("shards:") for s in args.settings):
        prepare = [sys.executable, os.path.join(ROOT, "tools", "prepare_dataset.py")]
        subprocess.run([*prepare, "--dataset", "digits", "--out", shards], check=True)
    seeds = args.seeds or [None]
    runs = [(v, seed, s) for v in args.variant for seed in seeds for s in args.settings]
    runs += [runs[0]] * args.repeat
    rows = []
    for i, (variant, seed, setting) in enumerate(runs):
        name = setting.replace(":", "_t") + ("" if seed is None else f"_seed{seed}")
        name += "" if len(args.variant) == 1 else f"_{variant[0]}"
        rows.append(run_setting(setting, os.path.join(args.out, f"{i:02d}_{name}"), args.epochs,
                                shards, seed, variant))  # fmt: skip
        r = rows[-1]
        print(f"{variant[0]}, {setting}, seed {'(config)' if seed is None else seed}: top-1 "
              f"error {r['top1_err']:.2f} % ({r['seconds']:.0f} s)", flush=True)  # fmt: skip
    errors = [r["top1_err"] for r in rows]
    lines = [
        f"Quickstart, {args.epochs} epochs, {os.cpu_count()} CPU cores "
        f"({time.strftime('%Y-%m-%d')}, revision {timing.source_revision()}):",
        "",
        "| variant | setting (engine:threads) | RNG_SEED | test top-1 error (%) | test images "
        "| wall time (s) | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seed = "config's" if r["seed"] is None else r["seed"]
        lines.append(
            f"| {r['variant']} | {r['setting']} | {seed} | {r['top1_err']:.2f} | "
            f"{r['num_samples']} | {r['seconds']:.0f} | "
            f"{'—' if r['load'] is None else format(r['load'], '.1f')} |"
        )
    lines += ["", f"Range: {min(errors):.2f} - {max(errors):.2f} % top-1 error."]
    if len(args.variant) > 1:
        lines += ["", "| variant | overrides | mean (%) | range (%) |", "|---|---|---|---|"]
        for name, opts in args.variant:
            own = [r["top1_err"] for r in rows if r["variant"] == name]
            lines.append(f"| {name} | `{opts or '(the config)'}` | {statistics.mean(own):.2f} "
                         f"| {min(own):.2f} - {max(own):.2f} |")  # fmt: skip
    if args.plot:
        plot(rows, [name for name, _ in args.variant], args.plot, args.epochs)
    if args.repeat:
        first = runs[0]
        same = [r["top1_err"] for r in rows if (r["setting"], r["seed"]) == first]
        verdict = "identical" if len(set(same)) == 1 else "different"
        lines.append(f"Repeats of {first[0]}: {verdict} ({same}).")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "readme_numbers.md"), "w") as f:
        f.write(text + "\n")
    return 0


def plot(rows, variants, path, epochs):
    """Each variant's runs (a point per run) and their mean (a bar), into ``path``."""
    import matplotlib  # optional: only --plot draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (optional, as above)

    fig, ax = plt.subplots(figsize=(1.3 * len(variants) + 2, 3.6))
    for x, name in enumerate(variants):
        own = [r["top1_err"] for r in rows if r["variant"] == name]
        ax.bar(x, statistics.mean(own), width=0.6, color="#c6dbef", zorder=1)
        ax.scatter([x] * len(own), own, color="#08519c", s=18, zorder=2)
    ax.set_xticks(range(len(variants)), variants, rotation=20, ha="right")
    ax.set_ylabel("final test top-1 error (%)")
    ax.set_title(f"quickstart, {epochs} epochs: each run (dot) and the mean (bar)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
