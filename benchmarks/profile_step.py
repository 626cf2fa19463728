#!/usr/bin/env python3
"""Where a training step's time goes: torch.profiler over a few of the trainer's own steps (LR set,
forward, loss, backward, clipping, optimizer step, EMA and meters as configured) of the model a
config describes, on synthetic batches on the device.

Writes OUT_DIR/profile.md: the top kernels by GPU time (on the CPU: the top operators by self CPU
time) and, on CUDA, how much of the profiled wall time the GPU was idle (no kernel or copy
running: launch overhead, host syncs, Python); and a json_stats line ``_type`` ``profile`` to
OUT_DIR/stdout.log. ``--trace`` also writes the Chrome trace (OUT_DIR/trace.json.gz).

    python benchmarks/profile_step.py --cfg configs/vit_b16.yaml OUT_DIR /tmp/prof \
        TRAIN.BATCH_SIZE 256
    python benchmarks/profile_step.py --cfg configs/vit_b16.yaml OUT_DIR /tmp/prof \
        TRAIN.COMPILE True
"""

import argparse
import gzip
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

from pycls import config  # noqa: E402
from pycls.core import benchmark as bench  # noqa: E402
from pycls.core import logging as logs  # noqa: E402
from pycls.core import timing  # noqa: E402
from pycls.core.trainer import setup_env  # noqa: E402

logger = logs.get_logger(__name__)
# The step runs on synthetic data: no data set is read
SYNTHETIC = ["TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cfg", required=True, help="config file")
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument("--warmup", type=int, default=5, help="steps before profiling (and compile)")
    p.add_argument("--top", type=int, default=25, help="rows of the kernel table")
    p.add_argument("--trace", action="store_true", help="also write the Chrome trace")
    p.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides: KEY VALUE ...")
    return p.parse_args(argv)


def merged_busy_us(intervals):
    """Length of the union of (start, end) intervals: time with at least one kernel running."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def device_events(prof):
    """The profiler's GPU-side events (kernels, copies, memsets)."""
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def kernel_table(events, steps, top):
    """Rows (name, calls per step, ms per step, share) of the longest kernels, by total time."""
    totals = {}
    for e in events:
        calls, us = totals.get(e.name, (0, 0.0))
        totals[e.name] = (calls + 1, us + e.time_range.elapsed_us())
    all_us = sum(us for _, us in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [(name, calls / steps, us / steps / 1e3, us / all_us) for name, (calls, us) in rows]


def cpu_table(prof, steps, top):
    """The same rows for operators by self CPU time (no GPU)."""
    avgs = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
    all_us = sum(a.self_cpu_time_total for a in avgs) or 1.0
    return [
        (
            a.key,
            a.count / steps,
            a.self_cpu_time_total / steps / 1e3,
            a.self_cpu_time_total / all_us,
        )
        for a in avgs[:top]
    ]


def markdown(header, rows, what):
    lines = [f"- {k}: {v}" for k, v in header.items()] + ["", f"**Top {what}**", ""]
    lines += ["| name | calls / step | ms / step | share |", "|---|---:|---:|---:|"]
    for name, calls, ms, share in rows:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {calls:.1f} | {ms:.3f} | {share:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    cfg = config.load_cfg(args.cfg, SYNTHETIC + list(args.opts))
    device = setup_env(cfg)
    # the trainer's own step, on synthetic batches (as --mode time runs it)
    _, step, (engine, *_) = bench.synthetic_training(cfg, device)
    engine.compile()  # TRAIN.COMPILE

    timing.warm_up(step, args.warmup)
    timing.sync(device)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    with torch.profiler.profile(activities=activities) as prof:
        # the profiled steps back to back, synchronised at the ends only (as in training)
        step_s = timing.time_calls(step, device, iters=1, group=args.steps).median
    stats = {
        "_type": "profile",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "arch": cfg.MODEL.ARCH or cfg.MODEL.TYPE,
        "batch_size": cfg.TRAIN.BATCH_SIZE,
        "amp": cfg.AMP.LEVEL if cfg.AMP.LEVEL == "O0" else f"{cfg.AMP.LEVEL}/{cfg.AMP.DTYPE}",
        "compile": cfg.TRAIN.COMPILE,
        "steps": args.steps,
        "step_ms": step_s * 1e3,  # with the profiler's own overhead
        "revision": timing.source_revision(),
        "load": timing.load_average(),
        "gpu_busy_frac": None,
    }
    if cuda:
        events = device_events(prof)
        spans = [(e.time_range.start, e.time_range.end) for e in events]
        if spans:
            window = max(e for _, e in spans) - min(s for s, _ in spans)
            stats["gpu_busy_frac"] = merged_busy_us(spans) / max(window, 1e-9)
        rows, what = kernel_table(events, args.steps, args.top), "kernels by GPU time"
    else:
        rows, what = cpu_table(prof, args.steps, args.top), "operators by self CPU time"
    stats["top"] = [name for name, *_ in rows[:5]]
    logs.log_json_stats(stats)
    busy = stats["gpu_busy_frac"]
    header = {k: v for k, v in stats.items() if k not in ("_type", "top", "gpu_busy_frac")}
    header["GPU idle within the profiled steps"] = "—" if busy is None else f"{1 - busy:.1%}"
    table = markdown(header, rows, what)
    with open(os.path.join(cfg.OUT_DIR, "profile.md"), "w") as f:
        f.write(table)
    print(table)
    if args.trace:
        raw = os.path.join(cfg.OUT_DIR, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    return stats


if __name__ == "__main__":
    main()
