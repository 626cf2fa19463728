#!/usr/bin/env python3
"""Forward + backward time of our zoo models (CNNs and ViTs) against upstream pycls's own code
(and timm's, with --timm), on the CPU or a GPU.

Usage: git clone https://github.com/facebookresearch/pycls /path/to/upstream-pycls
       python benchmarks/vs_upstream.py --upstream /path/to/upstream-pycls \
           [--models RegNetY-800MF ResNet-50 ViT-S/16]
       python benchmarks/vs_upstream.py --upstream /path/to/upstream-pycls --device cuda \
           --amp bf16 --channels-last --timm --batch 256 --pairs 30 --models RegNetY-4.0GF ResNet-50

--upstream (or the environment variable UPSTREAM_PYCLS) is a checkout of facebookresearch/pycls:
its ``pycls`` package and ``configs``, nothing of it copied here; it runs on the packages this
one installs (yacs, iopath, numpy). Both packages are called ``pycls``, so each contender lives
in its own Python process with its package first on the path. The processes build their model
and warm up, then take turns (pycls.core.timing.alternate): one iteration of forward + backward
(sum of the logits; default batch 8, 224 px, fp32) in one, then in the next, the order rotating
every round, so each round's times are measured under the same machine load. The ratio ours /
other is taken per round; the median ratio (and its quartiles) is the result. Threads are pinned
(--threads). Upstream's model must have our parameter count exactly (the same architecture);
timm's is reported beside it.

A ViT is compared at the settings both have: the pooled classifier (upstream's ``pooled``, no
class token) and the patchify stem; ours runs the recipes' batch-first layout, upstream its only
one (sequence first, ``nn.MultiheadAttention``). Its upstream config is written to a temporary
file from the sizes below.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pycls.core import timing  # noqa: E402

# The contenders' processes load the timing module by its path: upstream's process has another
# package named pycls first on its path
TIMING_PATH = os.path.join(ROOT, "pycls", "core", "timing.py")

# The upstream config file of each zoo model (the architecture only; nothing else is used)
UPSTREAM_CONFIGS = {
    "RegNetY-800MF": "configs/dds_baselines/regnety/RegNetY-800MF_dds_8gpu.yaml",
    "RegNetX-800MF": "configs/dds_baselines/regnetx/RegNetX-800MF_dds_8gpu.yaml",
    "ResNet-50": "configs/dds_baselines/resnet/R-50-1x64d_dds_8gpu.yaml",
    "EfficientNet-B0": "configs/dds_baselines/effnet/EN-B0_dds_8gpu.yaml",
    "RegNetY-4.0GF": "configs/dds_baselines/regnety/RegNetY-4.0GF_dds_8gpu.yaml",
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

# timm's name of each model (its own code: a third contender with --timm)
TIMM_NAMES = {
    "RegNetY-800MF": "regnety_008",
    "RegNetY-4.0GF": "regnety_040",
    "RegNetX-800MF": "regnetx_008",
    "ResNet-50": "resnet50",
    "EfficientNet-B0": "efficientnet_b0",
    "ViT-Ti/16": "vit_tiny_patch16_224",
    "ViT-S/16": "vit_small_patch16_224",
    "ViT-B/16": "vit_base_patch16_224",
}

_HEADER = """import importlib.util, json, os, sys
import torch
_spec = importlib.util.spec_from_file_location("pycls_timing", {timing!r})
timing = sys.modules["pycls_timing"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timing)
"""

# A worker: builds, warms up, prints "ready", then times one iteration per line it reads. An
# iteration is forward (under bfloat16 autocast with --amp bf16) and backward of the logits' sum;
# timing.time_calls synchronises the device at both ends, so its time is the device's.
_WORKER = """
torch.set_num_threads({threads})
torch.manual_seed(0)
device = torch.device({device!r})
fmt = torch.channels_last if {channels_last} else torch.contiguous_format
model = build().to(device, memory_format=fmt)
x = torch.randn({batch}, 3, {size}, {size}, device=device).contiguous(memory_format=fmt)
def step():
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled={amp}):
        out = model(x)
    out.float().sum().backward()
timing.warm_up(step, {warmup})
params = sum(p.numel() for p in model.parameters())
print(json.dumps({{"ready": params}}), flush=True)
for line in sys.stdin:
    print(json.dumps({{"time": timing.time_calls(step, device).median}}), flush=True)
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

_TIMM = """
import timm
def build():
    return timm.create_model({name!r}, pretrained=False).train()
"""


def _without_pycls(pythonpath):
    """PYTHONPATH without the folders that hold a ``pycls`` package (ours, or upstream's): the
    contender puts its own first; folders of requirements (yacs, iopath, ...) stay."""
    keep = [
        p for p in pythonpath.split(os.pathsep) if p and not os.path.isdir(os.path.join(p, "pycls"))
    ]
    return os.pathsep.join(keep)


class Worker:
    """A contender's process: built and warmed up once, then one timed iteration per request."""

    def __init__(self, code, threads):
        env = timing.pinned_env(threads)
        env["PYTHONPATH"] = _without_pycls(env.get("PYTHONPATH", ""))
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


def _contenders(name, args, upstream, tmp):
    """name -> code building the model, ours first: ours, upstream's (or ours again with
    --against-self) and timm's with --timm."""
    if name in VITS:
        zoo_name, sizes = VITS[name]
        kwargs = {"classifier": "pooled", "layout": "batch_first"}
        ours = _OURS.format(root=ROOT, name=zoo_name, kwargs=kwargs)
        config = os.path.join(tmp, f"{zoo_name}.yaml")
        with open(config, "w") as f:
            f.write(_UPSTREAM_VIT_YAML.format(*sizes))
    else:
        ours = _OURS.format(root=ROOT, name=name, kwargs={})
        config = UPSTREAM_CONFIGS[name]
    codes = {"ours": ours}
    if args.against_self:  # the control: two processes of ours measure the noise of the method
        codes["ours again"] = ours
    else:
        codes["upstream"] = _UPSTREAM.format(upstream=upstream, config=config)
    if args.timm:
        codes["timm"] = _TIMM.format(name=TIMM_NAMES[name])
    return codes


def compare(name, args, upstream, tmp):
    """Each contender in its own process; in every round each runs one iteration, the order
    rotating round by round; the ratios ours / other are taken per round."""
    worker = _WORKER.format(
        threads=args.threads, batch=args.batch, size=args.size, warmup=args.warmup,
        device=args.device, amp=args.amp == "bf16", channels_last=args.channels_last,
    )  # fmt: skip
    workers = {}
    header = _HEADER.format(timing=TIMING_PATH)
    try:
        for key, code in _contenders(name, args, upstream, tmp).items():
            workers[key] = Worker(header + code + worker, args.threads)
        others = [k for k in workers if k != "ours"]
        # The same architecture: upstream's (or ours again) has our parameter count exactly
        if workers[others[0]].params != workers["ours"].params:
            raise SystemExit(
                f"{name}: {workers['ours'].params} parameters here, "
                f"{workers[others[0]].params} {others[0]}"
            )
        rounds = timing.alternate(
            {k: w.time_one for k, w in workers.items()},
            args.pairs,
            log=lambda line: print(f"{name} {line.strip()}", flush=True),
            describe=lambda seconds: f"{seconds:.3f} s",
        )
    finally:
        for w in workers.values():
            w.close()
    result = dict(params=workers["ours"].params, pairs=args.pairs, load=rounds.load_range())
    result["ours_median_s"] = rounds.timing("ours").median
    for k in others:
        ratio = rounds.ratio("ours", k)
        tag = k.replace(" ", "_")
        result.update({
            f"{tag}_median_s": rounds.timing(k).median,
            f"{tag}_params": workers[k].params,
            f"ratio_{tag}_median": ratio.median,
            f"ratio_{tag}_q1": ratio.q1,
            f"ratio_{tag}_q3": ratio.q3,
        })  # fmt: skip
        print(
            f"{name}: ours/{k} {ratio.median:.3f} (quartiles {ratio.q1:.3f}-{ratio.q3:.3f}; "
            f"medians {result['ours_median_s']:.3f} s / {result[f'{tag}_median_s']:.3f} s)"
        )
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--upstream",
        default=os.environ.get("UPSTREAM_PYCLS"),
        help="a checkout of facebookresearch/pycls (default: $UPSTREAM_PYCLS)",
    )
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--amp", choices=("none", "bf16"), default="none")
    parser.add_argument("--channels-last", action="store_true", help="CNNs in channels_last")
    parser.add_argument("--timm", action="store_true", help="timm's model as a third contender")
    parser.add_argument(
        "--against-self",
        action="store_true",
        help="time ours against a second process of ours (the method's noise; ratio ~1)",
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    upstream = None
    if not args.against_self:
        if not args.upstream:
            raise SystemExit(
                "--upstream: give a checkout of facebookresearch/pycls (or set UPSTREAM_PYCLS): "
                "git clone https://github.com/facebookresearch/pycls DIR"
            )
        upstream = os.path.abspath(args.upstream)
        if not os.path.isfile(os.path.join(upstream, "pycls", "models", "anynet.py")):
            raise SystemExit(f"--upstream: {upstream} holds no pycls/models/anynet.py")
    print(f"revision {timing.source_revision()}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pycls-upstream-") as tmp:
        summary = {name: compare(name, args, upstream, tmp) for name in args.models}
    print("json_stats: " + json.dumps({"_type": "upstream_benchmark", **summary}))


if __name__ == "__main__":
    main()
