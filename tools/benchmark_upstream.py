#!/usr/bin/env python3
"""Forward + backward time of our zoo models (CNNs and ViTs) against upstream pycls's own code,
on the CPU.

Usage: python tools/benchmark_upstream.py --upstream DIR [--models RegNetY-800MF ResNet-50 ViT-S/16]

DIR is a checkout of facebookresearch/pycls (its ``pycls`` package and ``configs``; nothing of
it is copied here). Both packages are called ``pycls``, so each contender lives in its own
Python process with its package first on the path. Both processes build their model and warm
up, then take turns: one iteration of forward + backward (sum of the logits) at batch 8,
224 px, fp32 in one, then one in the other, the order swapped every pair, so each pair of
times is measured under the same machine load. The ratio ours / upstream is taken per pair;
the median pair ratio (and its quartiles) is the result. Threads are pinned (--threads).

A ViT is compared at the settings both have: the pooled classifier (upstream's ``pooled``, no
class token) and the patchify stem; ours runs the recipes' batch-first layout, upstream its only
one (sequence first, ``nn.MultiheadAttention``). Its upstream config is written to a temporary
file from the sizes below.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The upstream config file of each zoo model (the architecture only; nothing else is used)
UPSTREAM_CONFIGS = {
    "RegNetY-800MF": "configs/dds_baselines/regnety/RegNetY-800MF_dds_8gpu.yaml",
    "RegNetX-800MF": "configs/dds_baselines/regnetx/RegNetX-800MF_dds_8gpu.yaml",
    "ResNet-50": "configs/dds_baselines/resnet/R-50-1x64d_dds_8gpu.yaml",
    "EfficientNet-B0": "configs/dds_baselines/effnet/EN-B0_dds_8gpu.yaml",
}
# ViTs: our zoo name and upstream's VIT keys (NUM_LAYERS, NUM_HEADS, HIDDEN_DIM, MLP_DIM)
VITS = {
    "ViT-Ti/16": ("vit_ti16", (12, 3, 192, 768)),
    "ViT-S/16": ("vit_s16", (12, 6, 384, 1536)),
    "ViT-B/16": ("vit_b16", (12, 12, 768, 3072)),
}
_UPSTREAM_VIT_YAML = """MODEL:
  TYPE: vit
  NUM_CLASSES: 1000
VIT:
  PATCH_SIZE: 16
  STEM_TYPE: patchify
  NUM_LAYERS: {}
  NUM_HEADS: {}
  HIDDEN_DIM: {}
  MLP_DIM: {}
  CLASSIFIER_TYPE: pooled
"""

_HEADER = "import json, os, sys, time\nimport torch\n"

# A worker: builds, warms up, prints "ready", then times one iteration per line it reads
_WORKER = """
torch.set_num_threads({threads})
torch.manual_seed(0)
model = build()
x = torch.randn({batch}, 3, {size}, {size})
def step():
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
for _ in range({warmup}):
    step()
params = sum(p.numel() for p in model.parameters())
print(json.dumps({{"ready": params}}), flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    step()
    print(json.dumps({{"time": time.perf_counter() - start}}), flush=True)
"""

_OURS = """
sys.path.insert(0, {root!r})
from pycls.models import build_model
def build():
    return build_model({name!r}, **{kwargs!r}).train()
"""

_UPSTREAM = """
sys.path.insert(0, {upstream!r})
os.chdir({upstream!r})
import pycls.core.builders as builders
from pycls.core.config import cfg, load_cfg
def build():
    load_cfg({config!r})
    return builders.build_model().train()
"""


class Worker:
    def __init__(self, code, threads):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        env.pop("PYTHONPATH", None)  # the contender's package comes first, nothing else
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )
        self.params = self._read()["ready"]

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("a benchmark process failed (its error is above)")
        return json.loads(line)

    def time_one(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._read()["time"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def _quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def _contenders(name, upstream, tmp):
    """(our model's code, upstream's) for one model name."""
    if name not in VITS:
        ours = _OURS.format(root=ROOT, name=name, kwargs={})
        return ours, _UPSTREAM.format(upstream=upstream, config=UPSTREAM_CONFIGS[name])
    zoo_name, sizes = VITS[name]
    ours = _OURS.format(
        root=ROOT, name=zoo_name, kwargs={"classifier": "pooled", "layout": "batch_first"}
    )
    config = os.path.join(tmp, f"{zoo_name}.yaml")
    with open(config, "w") as f:
        f.write(_UPSTREAM_VIT_YAML.format(*sizes))
    return ours, _UPSTREAM.format(upstream=upstream, config=config)


def compare(name, args, upstream, tmp):
    worker = _WORKER.format(
        threads=args.threads, batch=args.batch, size=args.size, warmup=args.warmup
    )
    our_code, their_code = _contenders(name, upstream, tmp)
    ours = Worker(_HEADER + our_code + worker, args.threads)
    other = "ours again" if args.against_self else "upstream"
    if args.against_self:  # the control: two processes of ours measure the noise of the method
        their_code = our_code
    theirs = Worker(_HEADER + their_code + worker, args.threads)
    if ours.params != theirs.params:
        raise SystemExit(f"{name}: {ours.params} parameters here, {theirs.params} upstream")
    ratios, times = [], {"ours": [], "upstream": []}
    try:
        for i in range(args.pairs):
            first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
            t_first, t_second = first.time_one(), second.time_one()
            t_ours, t_theirs = (t_first, t_second) if first is ours else (t_second, t_first)
            times["ours"].append(t_ours)
            times["upstream"].append(t_theirs)
            ratios.append(t_ours / t_theirs)
            print(f"{name} pair {i + 1}: ours {t_ours:.3f} s, {other} {t_theirs:.3f} s")
    finally:
        ours.close()
        theirs.close()
    low, high = _quartiles(ratios)
    result = dict(
        params=ours.params,
        ours_median_s=statistics.median(times["ours"]),
        upstream_median_s=statistics.median(times["upstream"]),
        ratio_median=statistics.median(ratios),
        ratio_q1=low,
        ratio_q3=high,
        pairs=args.pairs,
    )
    print(
        f"{name}: ours/{other} {result['ratio_median']:.3f} (quartiles {low:.3f}-{high:.3f}; "
        f"medians {result['ours_median_s']:.3f} s / {result['upstream_median_s']:.3f} s)"
    )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="checkout of facebookresearch/pycls")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["RegNetY-800MF", "ResNet-50"],
        choices=[*UPSTREAM_CONFIGS, *VITS],
    )
    parser.add_argument("--pairs", type=int, default=10, help="timed iterations per contender")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument(
        "--against-self",
        action="store_true",
        help="time ours against a second process of ours (the method's noise; ratio ~1)",
    )
    args = parser.parse_args()
    upstream = os.path.abspath(args.upstream)
    if not os.path.isfile(os.path.join(upstream, "pycls", "models", "anynet.py")):
        raise SystemExit(f"--upstream: {upstream} holds no pycls/models/anynet.py")
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="pycls-upstream-") as tmp:
        summary = {name: compare(name, args, upstream, tmp) for name in args.models}
    print(f"load average after: {os.getloadavg()}")
    print("json_stats: " + json.dumps({"_type": "upstream_benchmark", **summary}))


if __name__ == "__main__":
    main()
