#!/usr/bin/env python3
"""Memory per process and step time of TRAIN.PARALLEL tensor at several tensor-parallel degrees.

For each degree tp in ``--tp``, tp processes (gloo on the CPU, NCCL on CUDA, one GPU each) train
the same ViT (``--arch``, ViT-B/16 by default) on random images, MESH.TP tp, MESH.DP 1 (no data
parallelism: what is measured is what tensor parallelism divides). Per process, on the step after
the optimizer's state exists:

- ``state_mb``: the model's state this process holds: parameters, gradients and the optimizer's
  moments (their local parts: a DTensor's local tensor), exact;
- ``saved_mb``: the activations the forward saves for the backward (``saved_tensors_hooks``,
  each storage counted once), exact;
- ``peak_mb``: measured: on CUDA ``max_memory_allocated``; on the CPU the peak resident set
  (``ru_maxrss``) gained from before the model was built to the end of the step (includes the
  allocator's slack and any transient buffer);
- ``step_s``: the median training step time (forward, backward, optimizer) of ``--steps`` steps.

The table (markdown, per degree the maximum over the processes) goes to OUT/tensor_parallel.md
and each row as a json_stats line (``_type`` ``tensor_parallel``) to OUT/stdout.log.

    python benchmarks/tensor_parallel.py --out /tmp/tp_mem                     # CPU: ViT-B/16
    python benchmarks/tensor_parallel.py --device cuda --tp 1 2 4 8 --batch 64 --out /tmp/tp
    python benchmarks/tensor_parallel.py --tiny --tp 1 2 --out /tmp/tp_tiny    # a rehearsal
"""

import argparse
import os
import resource
import statistics
import sys
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from pycls import config  # noqa: E402
from pycls import distributed as dist  # noqa: E402
from pycls.core import logging as logs  # noqa: E402
from pycls.core import timing  # noqa: E402
from pycls.core.trainer import build_training  # noqa: E402
from pycls.models import VIT_SPECS  # noqa: E402

TINY = ["VIT.PATCH_SIZE", "8", "VIT.DEPTH", "2", "VIT.WIDTH", "64", "VIT.NUM_HEADS", "4",
        "VIT.MLP_DIM", "128", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32"]  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/pycls_tensor_parallel", help="output folder")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--arch", default="vit_b16", choices=sorted(VIT_SPECS), help="the ViT")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel degrees")
    p.add_argument("--batch", type=int, default=8, help="images per step (the global batch)")
    p.add_argument("--steps", type=int, default=2, help="timed steps, after one untimed")
    p.add_argument("--amp", default="O0", choices=("O0", "O1", "O2", "O3"), help="AMP.LEVEL")
    p.add_argument("--tiny", action="store_true", help="a 2-block 64-wide ViT at 32 px")
    p.add_argument("opts", nargs=argparse.REMAINDER, help="more KEY VALUE config overrides")
    return p.parse_args(argv)


def run_config(args, tp):
    return config.load_cfg(
        None,
        [
            "MODEL.ARCH", "" if args.tiny else args.arch, *(TINY if args.tiny else []),
            "DEVICE", args.device, "AMP.LEVEL", args.amp, "AMP.CPU_LEVEL", "same",
            "TRAIN.PARALLEL", "tensor", "MESH.TP", str(tp), "MESH.DP", "1",
            "TRAIN.BATCH_SIZE", str(args.batch), "OPTIM.OPTIMIZER", "adamw",
            "VIT.CLASSIFIER", "pooled", "VIT.LAYOUT", "batch_first", *args.opts,
        ],
    )  # fmt: skip


def _local_bytes(t):
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes(module, optimizer):
    """Parameters, gradients and optimizer state of this process (local parts)."""
    total = 0
    for p in module.parameters():
        total += _local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0)
    for state in optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if torch.is_tensor(v) and v.ndim)
    return total


class SavedBytes:
    """Bytes of the tensors the forward saves for the backward, each storage once."""

    def __init__(self):
        self.seen, self.total = set(), 0

    def pack(self, t):
        local = t.to_local() if isinstance(t, DTensor) else t
        key = (local.untyped_storage().data_ptr(), local.device)
        if key not in self.seen:
            self.seen.add(key)
            self.total += local.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def _measure(rank, world, port, args, out_file):
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=world + 1, is_master=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        cfg = run_config(args, world)
        rss0 = peak_rss_mb()
        torch.manual_seed(rank)
        engine, optimizer, scaler, loss_fn, _ = build_training(cfg, device)
        size, n = cfg.TRAIN.IM_SIZE, args.batch // world
        g = torch.Generator().manual_seed(rank)
        images = torch.randn(n, 3, size, size, generator=g).to(device)
        labels = torch.randint(0, cfg.MODEL.NUM_CLASSES, (n,), generator=g).to(device)
        times, saved = [], SavedBytes()

        def train_step(last):
            optimizer.zero_grad(set_to_none=False)
            with saved.hooks() if last else _nothing():
                engine.forward_backward(images, labels, loss_fn, scaler)
            engine.step(optimizer, scaler)
            dist.barrier()

        for step in range(args.steps + 1):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            # the device synchronised at both ends (pycls.core.timing), the barrier inside
            last = step == args.steps
            times.append(timing.time_calls(partial(train_step, last), device).median)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = peak_rss_mb() - rss0
        row = {
            "tp": world,
            "rank": rank,
            "state_mb": state_bytes(engine.module, optimizer) / 2**20,
            "saved_mb": saved.total / 2**20,
            "peak_mb": peak,
            "step_s": statistics.median(times[1:]),
        }
        rows = [None] * world
        torch.distributed.all_gather_object(rows, row)
        if rank == 0:
            torch.save(rows, out_file)
    finally:
        torch.distributed.destroy_process_group()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure(args, tp):
    """The rows of the ``tp`` processes (one per process)."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, world_size=tp + 1, is_master=True, wait_for_workers=False
    )
    out_file = os.path.join(args.out, f"tp{tp}.pt")
    torch.multiprocessing.spawn(_measure, args=(tp, store.port, args, out_file), nprocs=tp)
    return torch.load(out_file, weights_only=False)


def table(rows, args):
    what = "tiny ViT" if args.tiny else args.arch
    lines = [
        f"{what}, {args.batch} images per step, AMP {args.amp}, {args.device}; per process, the "
        "largest over the processes of each degree:",
        "",
        "| MESH.TP | params + grads + Adam, MB | saved activations, MB | peak, MB | step, s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['state_mb']:.0f} | {r['saved_mb']:.0f} | {r['peak_mb']:.0f} "
            f"| {r['step_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    logs.setup_logging(args.out)
    if args.device == "cuda":
        have = torch.cuda.device_count()
        if max(args.tp) > have:
            raise SystemExit(f"--tp {max(args.tp)} needs that many GPUs; this machine has {have}")
    rows = []
    for tp in args.tp:
        per_rank = measure(args, tp)
        row = {k: max(r[k] for r in per_rank) for k in ("state_mb", "saved_mb", "peak_mb")}
        row.update(tp=tp, step_s=max(r["step_s"] for r in per_rank))
        logs.log_json_stats({"_type": "tensor_parallel", **row})
        rows.append(row)
    text = table(rows, args)
    with open(os.path.join(args.out, "tensor_parallel.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
