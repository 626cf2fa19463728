#!/usr/bin/env python3
"""Predicted images/s and scaling efficiency of DDP, FSDP2 and HSDP from 8 to 512 GPUs.

A model, not a measurement: from one GPU's training step (BENCHMARKS.md's H200 figures, or
``--step-ms``), the bytes each engine sends per step (``pycls.engines.mesh_traffic``, the
estimate the engines log and the tests hold to the bytes their collectives carry) and stated
link bandwidths, it prices every collective and overlaps it with the compute as the engine does:

- one GPU's step = forward + backward + optimizer step; forward : backward = 1 : 2 (their
  FLOPs); the per-GPU batch stays that of the one-GPU step (weak scaling);
- a collective over a group takes ``bytes sent per process / bandwidth + latency``; the
  bandwidth of a group within a machine is NVLink's; a group across machines uses the machine's
  network share of its processes (a ring crosses each machine's network once per direction, so a
  group with all 8 processes of each machine has the machine's whole network, HSDP's replica
  groups, with 1, an eighth of it), at most NVLink's; both times an efficiency (achieved over
  peak, as nccl-tests' bus bandwidth measures it);
- DDP: the gradient buckets' all-reduce runs during the backward; what does not fit in it, and
  the last bucket, come after it; then the optimizer steps over every parameter;
- FSDP2: the next unit's all-gather runs during the current unit's forward (prefetch), the first
  is exposed; in the backward each block's re-gather and reduce-scatter (and, under HSDP, the
  replicas' all-reduce, on the other link) run during the next block's backward, the last ones
  after it; the root unit (embedding, head) has no compute of its own to hide behind; the
  optimizer steps over this process's shard (1 / shard of the parameters).

Not modelled: stragglers, the data loader, FSDP2's copies into and out of its gather buffers,
NCCL's tree and NVLink-SHARP algorithms (which beat the ring at scale), and a network shared with
other jobs. ``docs/distributed.md`` states the assumptions and compares the model with published
figures (``--check`` prints that comparison).

    python benchmarks/scaling_model.py                         # the table, ViT-B/16, -H/14, -g/14
    python benchmarks/scaling_model.py --plot docs/scaling_model.png
    python benchmarks/scaling_model.py --network ethernet --step-ms vit_b16=80 --check
"""

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pycls.engines.base import fsdp_units  # noqa: E402
from pycls.engines.mesh_traffic import Unit, ddp_traffic, padded, ring  # noqa: E402
from pycls.models import build_vit  # noqa: E402
from pycls.models.vit.complexity import vit_complexity  # noqa: E402

GPUS = (8, 16, 32, 64, 128, 256, 512)
ENGINES = ("ddp", "fsdp", "hsdp")
DDP_BUCKET = 25 * 2**20  # DDP.BUCKET_CAP_MB's default, in bytes


@dataclass(frozen=True)
class Cluster:
    """Machines of ``gpus_per_node`` GPUs: NVLink per GPU and the machine's network, bytes/s in
    each direction; ``efficiency``: achieved over peak; latencies per collective, s;
    ``jitter``: the spread of a GPU's step time (standard deviation over the mean), which makes
    a synchronous step wait for the slowest of n GPUs: the expected maximum of n normal draws,
    about ``jitter * sqrt(2 ln n)`` over the mean (``straggler``)."""

    gpus_per_node: int
    nvlink: float
    node_network: float
    efficiency: float = 0.8
    latency_node: float = 10e-6
    latency_network: float = 30e-6
    jitter: float = 0.0


# H100 / H200 SXM: NVLink 4, 900 GB/s per GPU in both directions together (NVIDIA's datasheets);
# DGX H100 / H200: 8 ConnectX-7 of 400 Gb/s, one per GPU (DGX user guide), 50 GB/s each way;
# the Ethernet cluster: one 100 Gb/s port per machine. JITTER: fitted (``fit_jitter``) so that
# torchtitan's published FSDP2 run keeps its 8-GPU to 128-GPU ratio (CHECKS' first entry)
JITTER = 0.0253
NETWORKS = {
    "infiniband": Cluster(gpus_per_node=8, nvlink=450e9, node_network=8 * 50e9, jitter=JITTER),
    "ethernet": Cluster(gpus_per_node=8, nvlink=450e9, node_network=12.5e9, jitter=JITTER),
}


@dataclass(frozen=True)
class Workload:
    """A model's FSDP units (``mesh_traffic.Unit``: the blocks, then the root), one GPU's step
    and what it is made of."""

    name: str
    units: tuple
    batch: int  # per GPU
    step_s: float  # one GPU: forward, backward, optimizer step
    optimizer_s: float
    grad_bytes: int  # as DDP all-reduces them (fp32)
    reduce_bytes: int = 4
    source: str = ""

    @property
    def depth(self):
        return len(self.units) - 1

    @property
    def compute_s(self):
        return self.step_s - self.optimizer_s


# One H200 (BENCHMARKS.md, "First GPU run": --mode time, every block compiled, bf16):
# (batch, step ms, optimizer step ms, AMP level). ViT-g/14 was not measured: its step is
# ViT-H/14's at the same utilisation (FLOPs per image x batch), its optimizer step scaled with
# the parameters
MEASURED = {
    "vit_b16": (256, 84.6, 1.25, "O1"),
    "vit_h14": (64, 176.9, 8.42, "O2"),
}
G14_BATCH = 32


def vit_workload(arch, step_ms=None):
    """The Workload of a pycls ViT (built on the meta device: shapes, no storage)."""
    with torch.device("meta"):
        model = build_vit(arch)
    params = sum(p.numel() for p in model.parameters())
    if arch in MEASURED:
        batch, ms, opt_ms, _ = MEASURED[arch]
        source = "measured on one H200 (BENCHMARKS.md)"
    else:
        batch, ms_h, opt_h, _ = MEASURED["vit_h14"]
        with torch.device("meta"):
            h14 = build_vit("vit_h14")
        flops = vit_complexity(model.args)["flops"] * G14_BATCH
        flops_h = vit_complexity(h14.args)["flops"] * batch
        opt_ms = opt_h * params / sum(p.numel() for p in h14.parameters())
        batch, ms = G14_BATCH, (ms_h - opt_h) * flops / flops_h + opt_ms
        source = "ViT-H/14's H200 step scaled by FLOPs (same utilisation)"
    if step_ms is not None:
        ms, source = step_ms, "given on the command line"
    units = tuple(fsdp_units(model, 2))  # bfloat16 gathers; gradients reduced in fp32
    return Workload(arch, units, batch, ms / 1e3, opt_ms / 1e3, 4 * params, source=source)


# ------------------------------------------------------------------------------------------------ #
# Collectives and the engines' steps
# ------------------------------------------------------------------------------------------------ #


def bandwidth(cluster, size, per_node):
    """Bytes/s of a ring over ``size`` processes, ``per_node`` of them on each machine."""
    if per_node >= size:
        return cluster.nvlink * cluster.efficiency
    share = cluster.node_network * per_node / cluster.gpus_per_node
    return min(cluster.nvlink, share) * cluster.efficiency


def seconds(sent, cluster, size, per_node):
    """Time of a collective over ``size`` processes (``per_node`` on each machine) in which each
    sends ``sent`` bytes."""
    if size <= 1 or sent == 0:
        return 0.0
    latency = cluster.latency_node if per_node >= size else cluster.latency_network
    return sent / bandwidth(cluster, size, per_node) + latency


def ddp_step(w, n, cluster):
    """DDP over ``n`` GPUs (consecutive ranks per machine): one step, in seconds. Its buckets
    are ready one after another through the backward (evenly) and all-reduced one at a time."""
    per_node = min(n, cluster.gpus_per_node)
    buckets = math.ceil(w.grad_bytes / DDP_BUCKET)
    sent = ddp_traffic(w.grad_bytes / buckets, 0, n)["dp_replicate"]
    each = seconds(sent, cluster, n, per_node)
    backward = w.compute_s * 2 / 3
    done = 0.0
    for k in range(1, buckets + 1):
        done = max(done, backward * k / buckets) + each
    return w.compute_s / 3 + done + w.optimizer_s


def unit_seconds(w, unit, cluster, shard, replicate):
    """(all-gather, reduce-scatter, the replicas' all-reduce) of one FSDP2 unit."""
    per_node = min(shard, cluster.gpus_per_node)
    gathered = padded(unit.shapes, shard) * unit.param_bytes
    reduced = padded(unit.grad_shapes, shard) * w.reduce_bytes
    gather = seconds(ring(gathered, shard), cluster, shard, per_node)
    scatter = seconds(ring(reduced, shard), cluster, shard, per_node)
    # a replica group holds one process of each machine
    across = seconds(2 * ring(reduced / shard, replicate), cluster, replicate, 1)
    return gather, scatter, across


def fsdp_step(w, n, cluster, replicate=1):
    """FSDP2 over ``n`` GPUs in ``replicate`` replicas (HSDP): one step, in seconds."""
    shard = n // replicate
    *blocks, root = [unit_seconds(w, u, cluster, shard, replicate) for u in w.units]
    f, b = w.compute_s / 3 / w.depth, w.compute_s * 2 / 3 / w.depth
    # forward: the root's and the first block's gathers exposed, each next one behind a block
    forward = root[0] + blocks[0][0] + sum(max(f, g) for g, _, _ in blocks[1:]) + f
    # backward, last block first: its gather again (freed after the forward), exposed; behind
    # each block's backward the previous block's gather and this one's reduce-scatter (one
    # link) and its replicas' all-reduce (the other); the first block's reduce-scatter and
    # all-reduce, and the root's, after the last compute
    backward = blocks[-1][0] + b + blocks[0][1] + blocks[0][2] + root[1] + root[2]
    for earlier, later in zip(blocks[:-1], blocks[1:]):
        backward += max(b, earlier[0] + later[1], later[2])
    return forward + backward + w.optimizer_s / shard


def straggler(cluster, n):
    """The factor by which ``n`` GPUs that each take a normally spread step wait for the slowest:
    1 + jitter * sqrt(2 ln n) (the leading term of the expected maximum of n draws)."""
    return 1.0 + cluster.jitter * math.sqrt(2 * math.log(n))


def step_seconds(w, engine, n, cluster):
    """One step of ``engine`` ("ddp", "fsdp" or "hsdp": one replica per machine) on ``n`` GPUs."""
    if n == 1:
        return w.step_s
    if engine == "ddp":
        return ddp_step(w, n, cluster) * straggler(cluster, n)
    replicate = max(1, n // cluster.gpus_per_node) if engine == "hsdp" else 1
    return fsdp_step(w, n, cluster, replicate) * straggler(cluster, n)


def predict(w, cluster, gpus=GPUS, engines=ENGINES):
    """Rows of {model, engine, gpus, step_ms, images_s, efficiency}: efficiency is images/s per
    GPU over one GPU's."""
    rows = []
    for engine in engines:
        for n in gpus:
            t = step_seconds(w, engine, n, cluster)
            rows.append(dict(model=w.name, engine=engine, gpus=n, step_ms=1e3 * t,
                             images_s=n * w.batch / t, efficiency=w.step_s / t))  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ #
# Published multi-GPU figures the model can be checked against
# ------------------------------------------------------------------------------------------------ #


def llama3_8b_units():
    """Llama 3.1 8B as FSDP2 units (torchtitan: a unit per block, then the root): shapes as
    ``(rows, rest)``, bfloat16 gathers."""
    d, kv, ffn, vocab = 4096, 1024, 14336, 128256
    block = ((d, d), (kv, d), (kv, d), (d, d), (ffn, d), (d, ffn), (ffn, d), (d, 1), (d, 1))
    root = ((vocab, d), (vocab, d), (d, 1))
    return tuple([Unit(block, block, 2)] * 32 + [Unit(root, root, 2)])


def calibrated(w, engine, n, step_s, cluster):
    """``w`` with the one-GPU compute that makes ``engine`` on ``n`` GPUs take ``step_s`` (a
    published step), found by bisection."""
    low, high = 0.0, step_s
    for _ in range(60):
        mid = (low + high) / 2
        trial = replace(w, step_s=mid + w.optimizer_s)
        low, high = (mid, high) if step_seconds(trial, engine, n, cluster) < step_s else (low, mid)
    return replace(w, step_s=low + w.optimizer_s)


# Each: what was run, the published per-GPU throughput at each GPU count, the engines to price,
# the workload (units, per-GPU batch) and the source
CHECKS = {
    "torchtitan Llama 3.1 8B, FSDP2, H100, 400 Gb/s per GPU": dict(
        published={8: 5762, 128: 5605},  # tokens/s per GPU
        engines=("fsdp",),
        workload=Workload("llama3_8b", llama3_8b_units(), 2 * 8192, 1.0, 0.0, 4 * 8_030_261_248),
        source="github.com/pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md "
        "(revision b5bcd76), tables 1 and 3, FSDP without torch.compile",
    ),
    "NeMo ViT-g/14, DGX H100 (8 to 128 GPUs)": dict(
        published={8: 1428 / 8, 16: 2846 / 16, 32: 5737 / 32, 64: 11222 / 64, 128: 21561 / 128},
        engines=ENGINES,
        workload=None,  # ViT-g/14 at G14_BATCH images per GPU (the page does not give it)
        source="docs.nvidia.com/nemo-framework/user-guide/latest/MultimodalModels/"
        "VisionLanguageFoundation/Vit/Perf.html (samples/s of 1 to 16 DGX H100 nodes)",
    ),
}


def fit_jitter(cluster):
    """The jitter with which the model keeps the first check's ratio of its largest run's
    per-GPU throughput to its smallest's (bisection)."""
    c = next(iter(CHECKS.values()))
    w, engine = c["workload"], c["engines"][0]
    small, large = min(c["published"]), max(c["published"])
    want = c["published"][large] / c["published"][small]
    low, high = 0.0, 0.2
    for _ in range(60):
        mid = (low + high) / 2
        trial = replace(cluster, jitter=mid)
        fitted = calibrated(w, engine, small, w.batch / c["published"][small], trial)
        ratio = step_seconds(fitted, engine, small, trial) / step_seconds(
            fitted, engine, large, trial
        )
        low, high = (mid, high) if ratio > want else (low, mid)
    return (low + high) / 2


def check(cluster):
    """Rows of {check, engine, gpus, published, predicted} (per-GPU throughput): the model
    calibrated on each check's smallest run, predicting the others."""
    rows = []
    for name, c in CHECKS.items():
        w = c["workload"] or vit_workload("vit_g14")
        base = min(c["published"])
        for engine in c["engines"]:
            fitted = calibrated(w, engine, base, w.batch / c["published"][base], cluster)
            for n, published in sorted(c["published"].items()):
                t = step_seconds(fitted, engine, n, cluster)
                rows.append(dict(check=name, engine=engine, gpus=n, published=published,
                                 predicted=fitted.batch / t))  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ #
# Output
# ------------------------------------------------------------------------------------------------ #


def table(rows):
    lines = ["| model | engine | " + " | ".join(f"{n} GPUs" for n in GPUS) + " |"]
    lines.append("|---|---|" + "---:|" * len(GPUS))
    for model in dict.fromkeys(r["model"] for r in rows):
        for engine in ENGINES:
            mine = {r["gpus"]: r for r in rows if r["model"] == model and r["engine"] == engine}
            cells = [f"{mine[n]['images_s']:,.0f} ({100 * mine[n]['efficiency']:.0f} %)"
                     for n in GPUS]  # fmt: skip
            lines.append(f"| {model} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_table(rows):
    lines = ["| published run | engine priced | GPUs | published / GPU | predicted / GPU |"]
    lines.append("|---|---|---:|---:|---:|")
    for r in rows:
        lines.append(f"| {r['check']} | {r['engine']} | {r['gpus']} | {r['published']:,.1f} | "
                     f"{r['predicted']:,.1f} |")  # fmt: skip
    return "\n".join(lines)


def plot(rows, path):
    """Efficiency against GPUs: a panel per network (rows) and model (columns)."""
    import matplotlib  # slow to import, needed only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    networks = list(dict.fromkeys(r["network"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(networks), len(models), squeeze=False, sharey=True,
                             figsize=(3.8 * len(models), 3.0 * len(networks)))  # fmt: skip
    for (i, network), (j, model) in itertools.product(enumerate(networks), enumerate(models)):
        ax = axes[i][j]
        for engine, style in zip(ENGINES, ("o-", "s--", "^-")):
            mine = [r for r in rows if (r["network"], r["model"], r["engine"]) ==
                    (network, model, engine)]  # fmt: skip
            ax.plot([r["gpus"] for r in mine], [100 * r["efficiency"] for r in mine], style,
                    label=engine)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(GPUS, [str(n) for n in GPUS])
        ax.set_ylim(0, 110)
        ax.set_title(f"{model}, {network}", fontsize=10)
        ax.grid(alpha=0.3)
        if i == len(networks) - 1:
            ax.set_xlabel("GPUs (8 per machine)")
    for i in range(len(networks)):
        axes[i][0].set_ylabel("% of one GPU's images/s")
    axes[0][0].legend()
    fig.suptitle("Predicted weak scaling (benchmarks/scaling_model.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["vit_b16", "vit_h14", "vit_g14"])
    p.add_argument("--networks", nargs="+", default=sorted(NETWORKS), choices=sorted(NETWORKS))
    p.add_argument("--efficiency", type=float, help="achieved over peak bandwidth (0.8)")
    p.add_argument(
        "--step-ms",
        nargs="*",
        default=[],
        metavar="MODEL=MS",
        help="a measured one-GPU step instead of the default (its batch stays)",
    )
    p.add_argument("--check", action="store_true", help="compare with published figures")
    p.add_argument("--plot", help="write the efficiency plot here (png)")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    given = dict(item.split("=") for item in args.step_ms)
    workloads = [vit_workload(a, float(given[a]) if a in given else None) for a in args.models]
    for w in workloads:
        print(f"{w.name}: {w.batch} images per GPU, one-GPU step {1e3 * w.step_s:.1f} ms "
              f"({w.source})")  # fmt: skip
    out = {"rows": [], "check": []}
    for network in args.networks:
        cluster = NETWORKS[network]
        if args.efficiency:
            cluster = replace(cluster, efficiency=args.efficiency)
        rows = [{"network": network, **r} for w in workloads for r in predict(w, cluster)]
        print(f"\nimages/s (efficiency), {network}\n" + table(rows))
        out["rows"] += rows
        if args.check and network == "infiniband":  # the published runs' networks
            out["check"] = check(cluster)
            print("\n" + check_table(out["check"]))
    if args.plot:
        plot(out["rows"], args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
