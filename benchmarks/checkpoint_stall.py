#!/usr/bin/env python3
"""How long a checkpoint holds the training loop, written synchronously and in the background
(TRAIN.ASYNC_CHECKPOINT), at a ViT's real size: the whole write, or the copy to host memory.

The model and its AdamW optimizer are built as the trainer builds them (at 32 px: a checkpoint's
bytes do not depend on the image size but for the position embedding's few rows), the optimizer's
state filled by one step, and the checkpoint saved through the trainer's own ``RunCheckpoints``,
synchronous and asynchronous rounds alternating. The stall is the time ``save`` holds the loop:
the whole write when synchronous; the copy to host memory when asynchronous (its write then goes
on in a thread, and is waited for outside the stall). The first asynchronous save allocates its
host copy; the later ones copy into it. Two layouts: ``file`` (one ``.pyth``
written by rank 0: engines none, DDP) and ``sharded`` (a DCP folder: FSDP2, here in a process
group of one, written by ``async_save``).

Prints a table and writes OUT/checkpoint_stall.json: per layout, mode and round the stall (wall
seconds, and the main thread's CPU seconds) and the whole write's seconds, the checkpoint's
bytes, the load average. Each checkpoint is removed once measured: the disk holds one at a time
(ViT-B/16 with AdamW: 1.04 GB; ViT-L/16: 3.65 GB). Memory: the model, its gradients, the AdamW
state and one host copy (ViT-L/16: 12.5 GB at its peak, measured).

    python benchmarks/checkpoint_stall.py --arch vit_b16 --out /tmp/stall
    python benchmarks/checkpoint_stall.py --arch vit_l16 --rounds 2 --out /tmp/stall_l
"""

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pycls import config  # noqa: E402
from pycls import distributed as dist  # noqa: E402
from pycls.core import timing  # noqa: E402
from pycls.core.run_checkpoints import RunCheckpoints  # noqa: E402
from pycls.core.trainer import build_training  # noqa: E402

LAYOUTS = {"file": "none", "sharded": "fsdp"}


def build(arch, parallel, out_dir):
    """{"sync": RunCheckpoints, "async": RunCheckpoints} of one engine holding ``arch`` under
    ``parallel``, after one AdamW step on random images (so every state tensor exists), and the
    bytes of its state."""
    cfgs = {mode: config.load_cfg(None, [
        "MODEL.ARCH", arch, "MODEL.NUM_CLASSES", "1000", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE",
        "32", "DEVICE", "cpu", "OPTIM.OPTIMIZER", "adamw", "TRAIN.PARALLEL", parallel,
        "TRAIN.ASYNC_CHECKPOINT", str(mode == "async"), "OUT_DIR", os.path.join(out_dir, mode),
        "AMP.CPU_LEVEL", "same"]) for mode in ("sync", "async")}  # fmt: skip
    engine, optimizer, scaler, loss_fn, _ = build_training(cfgs["sync"], torch.device("cpu"))
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2,))
    engine.forward_backward(images, labels, loss_fn, scaler)
    engine.step(optimizer, scaler)
    tensors = [*engine.module.state_dict().values()]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    runs = {m: RunCheckpoints(c, engine, optimizer, scaler) for m, c in cfgs.items()}
    return runs, nbytes


def one_save(checkpoints):
    """(stall wall s, stall main-thread CPU s, total write s) of one save after epoch 1."""
    clock = timing.Stopwatch()
    checkpoints.save(1, 0, {})
    stall, stall_cpu = clock.wall(), clock.cpu()
    checkpoints.wait()
    total = clock.wall()
    shutil.rmtree(os.path.join(checkpoints.cfg.OUT_DIR, "checkpoints"))
    return stall, stall_cpu, total


def measure(arch, out_dir, rounds=3, layouts=tuple(LAYOUTS)):
    """{layout: {"sync"|"async": {stall, stall_cpu, write: [per round]}, "bytes": n}}, the modes
    alternating in each round (sync first, then async) in one process."""
    results = {}
    for layout in layouts:
        parallel = LAYOUTS[layout]
        group = parallel != "none" and not dist.is_initialized()
        if group:
            dist.init_single_process_group("cpu")
        try:
            runs, nbytes = build(arch, parallel, os.path.join(out_dir, layout))
            per_mode = {mode: {"stall": [], "stall_cpu": [], "write": []} for mode in runs}
            for _ in range(rounds):
                for mode in ("sync", "async"):
                    stall, cpu, total = one_save(runs[mode])
                    per_mode[mode]["stall"].append(stall)
                    per_mode[mode]["stall_cpu"].append(cpu)
                    per_mode[mode]["write"].append(total)
            results[layout] = {**per_mode, "bytes": nbytes}
            del runs
        finally:
            if group:
                dist.destroy_process_group()
    return results


def report(arch, results):
    """A markdown table: the stalls of the first async save (which allocates its host copy) and
    of the later ones (which reuse it), against the sync saves' best."""
    lines = [
        f"{arch}: the loop's stall per checkpoint save, seconds (load {timing.load_average():.1f})",
        "| layout | bytes | sync: wall (CPU) | async, first save: wall | async, later: wall "
        "(CPU) | later / sync: wall, CPU | async write: wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, r in results.items():
        sync, sync_cpu = min(r["sync"]["stall"]), min(r["sync"]["stall_cpu"])
        first, later = r["async"]["stall"][0], min(r["async"]["stall"][1:] or r["async"]["stall"])
        cpu = min(r["async"]["stall_cpu"][1:] or r["async"]["stall_cpu"])
        lines.append(
            f"| {layout} | {r['bytes'] / 1e9:.2f} GB | {sync:.2f} ({sync_cpu:.2f}) | {first:.2f} | "
            f"{later:.2f} ({cpu:.2f}) | {later / sync:.2f}, {cpu / sync_cpu:.2f} | "
            f"{min(r['async']['write']):.2f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="vit_b16", help="a ViT variant (vit_b16, vit_l16, ...)")
    parser.add_argument("--rounds", type=int, default=3, help="saves per layout and mode")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", required=True, help="a folder for the checkpoints and results")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    load_before = timing.load_average()
    results = measure(args.arch, args.out, args.rounds, tuple(args.layouts))
    text = report(args.arch, results)
    print(text)
    record = {"arch": args.arch, "results": results, "load_before": load_before,
              "load_after": timing.load_average(), "torch": torch.__version__,
              "threads": torch.get_num_threads()}  # fmt: skip
    with open(os.path.join(args.out, "checkpoint_stall.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
