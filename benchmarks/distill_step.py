#!/usr/bin/env python3
"""What distillation costs per training step: the trainer's own step (``--mode time``'s, on
synthetic batches) of one student without a teacher and with one, at each AMP level.

The student keeps its distillation token in both (``DISTILL.TYPE none`` against ``hard``), so the
difference is the teacher's forward pass and the distillation term. The teacher's weights do not
change its time: the script writes randomly initialised ones where the config expects a file
(``--teacher zoo:NAME``: the zoo model's published file in a temporary MODEL.ZOO_DIR; ``--teacher
cfg:FILE``: the model a pycls config describes, as a model_final.safetensors). Every
measurement runs in a fresh process pinned to ``--threads`` threads and the contenders take turns
(pycls.core.timing.alternate); the table holds each contender's median step time, the ratio of
the distilled step to the plain one (of the pooled medians, and per round with quartiles) and the
load average.

    python benchmarks/distill_step.py --out /tmp/distill          # the quickstart pair on a CPU
    python benchmarks/distill_step.py --cfg configs/deit_b16_distilled.yaml \\
        --teacher zoo:RegNetY-16GF --amp O1 --batch-size 256 --device cuda --compile
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pycls import config  # noqa: E402
from pycls.checkpoint import weight_files  # noqa: E402
from pycls.core import builders, timing  # noqa: E402
from pycls.core.benchmark import synthetic_training  # noqa: E402
from pycls.models import zoo  # noqa: E402

QUICKSTART_VIT = os.path.join(ROOT, "configs", "quickstart_distilled.yaml")
QUICKSTART_TEACHER = "cfg:" + os.path.join(ROOT, "configs", "quickstart_regnet.yaml")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cfg", default=QUICKSTART_VIT, help="the student's config")
    p.add_argument("--teacher", default=QUICKSTART_TEACHER, help="zoo:NAME or cfg:FILE")
    p.add_argument("--amp", nargs="+", default=["O0", "O1", "O2"], help="AMP levels (bfloat16)")
    p.add_argument("--batch-size", type=int, help="TRAIN.BATCH_SIZE (default: the config's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--compile", action="store_true", help="TRAIN.COMPILE (student and teacher)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="turns each contender takes")
    p.add_argument("--iters", type=int, default=20, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per process")
    p.add_argument("--out", help="folder for distill.md and distill.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: one measurement, in this process
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ #
# The teacher's file, then the worker: one contender, one process
# ------------------------------------------------------------------------------------------------ #


def write_teacher(teacher, folder):
    """(DISTILL.TEACHER, extra overrides) for a teacher of random weights written in ``folder``."""
    torch.manual_seed(0)
    if teacher.startswith("zoo:"):
        name = teacher[len("zoo:") :]
        state = zoo.build_model(name).state_dict()
        torch.save({"model_state": state}, zoo.weights_path(name, folder))
        return teacher, ["MODEL.ZOO_DIR", folder]
    if not teacher.startswith("cfg:"):
        raise SystemExit(f"--teacher {teacher!r}: zoo:NAME or cfg:FILE")
    cfg = config.load_cfg(teacher[len("cfg:") :], [])
    path = os.path.join(folder, "model_final.safetensors")
    model = builders.build_model(cfg)
    weight_files.save_safetensors(model.state_dict(), path, {"naming": "pycls", "cfg": cfg.dump()})
    return path, []


def run_worker(job):
    torch.set_num_threads(job["threads"])
    cfg = config.load_cfg(job["cfg"], job["overrides"])
    device = torch.device(job["device"])
    _, run, (engine, *_) = synthetic_training(cfg, device)
    if cfg.TRAIN.COMPILE:
        engine.compile()
    clock = time.process_time if job["threads"] == 1 and job["device"] == "cpu" else None
    steps = timing.time_calls(run, device, job["warmup"], job["iters"], clock=clock)
    return {"times": list(steps.times)}


def measure(job):
    return timing.run_pinned(__file__, job, job["threads"])


# ------------------------------------------------------------------------------------------------ #
# The driver: rounds, table
# ------------------------------------------------------------------------------------------------ #


def jobs(args, teacher, extra):
    """{contender id: job}: the plain and the distilled step at each AMP level."""
    common = ["AMP.CPU_LEVEL", "same", "AMP.DTYPE", "bfloat16", "DEVICE", args.device, *extra]
    common += ["DISTILL.TEACHER", teacher, "TRAIN.COMPILE", str(args.compile)]
    if args.batch_size:
        common += ["TRAIN.BATCH_SIZE", str(args.batch_size)]
    out = {}
    for level in args.amp:
        for kind in ("none", "hard"):
            overrides = [*common, "AMP.LEVEL", level, "DISTILL.TYPE", kind]
            out[f"{kind}|{level}"] = dict(
                cfg=args.cfg, overrides=overrides, threads=args.threads, device=args.device,
                iters=args.iters, warmup=args.warmup,
            )  # fmt: skip
    return out


def summarize(rounds, levels):
    lines = [
        "| AMP level | step without teacher, ms | with teacher, ms | distilled / plain "
        "| per-round ratios, median (quartiles) |",
        "|---|---:|---:|---:|---|",
    ]
    for level in levels:
        plain, distilled = f"none|{level}", f"hard|{level}"
        ratio = rounds.ratio(distilled, plain)
        lines.append(
            f"| {level} | {rounds.timing(plain).median * 1e3:.1f} "
            f"| {rounds.timing(distilled).median * 1e3:.1f} | {ratio.of_medians:.2f}x "
            f"| {ratio.median:.2f} ({ratio.q1:.2f}-{ratio.q3:.2f}) |"
        )
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    with tempfile.TemporaryDirectory(prefix="pycls-teacher-") as folder:
        teacher, extra = write_teacher(args.teacher, folder)
        started = datetime.datetime.now(datetime.timezone.utc)
        rounds = timing.alternate(
            {cid: partial(measure, job) for cid, job in jobs(args, teacher, extra).items()},
            args.rounds,
            log=partial(print, flush=True),
            describe=lambda out: f"{timing.Timing(tuple(out['times'])).median * 1e3:.1f} ms",
        )
    clock = "CPU" if args.threads == 1 and args.device == "cpu" else "wall"
    header = [
        f"Date {started:%Y-%m-%d %H:%M} UTC, revision {timing.source_revision()}, torch "
        f"{torch.__version__}, {args.device}, student {os.path.relpath(args.cfg, ROOT)}, teacher "
        f"{args.teacher}, {args.rounds} rounds x {args.iters} steps per contender, {clock} time, "
        f"{args.threads} thread(s), load average (1 min) {rounds.load_range()}.",
        "Command: `python benchmarks/distill_step.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "",
    ]
    table = header + summarize(rounds, args.amp)
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "distill.md"), "w") as f:
            f.write("\n".join(table) + "\n")
        with open(os.path.join(args.out, "distill.json"), "w") as f:
            json.dump({cid: rounds.times(cid) for cid in rounds.results}, f)


if __name__ == "__main__":
    main()
