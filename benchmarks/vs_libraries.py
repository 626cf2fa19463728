#!/usr/bin/env python3
"""Training throughput of pycls's ViT against torchvision's (and timm's), plus an ablation.

Everything runs in this one process on one device, on synthetic batches already on the device,
timing full training steps (forward, loss, backward, optimizer step):

- libraries, same size, batch and precision (autocast in AMP.DTYPE, i.e. AMP level O1):
  torchvision's VisionTransformer and timm's (when importable) with torch.optim.AdamW, pycls's
  with its own AdamW (contiguous buffers), in torchvision's architecture (class token,
  batch-first) and in pycls's default one (pooled classifier, batch-second);
- each library at its best settings (torch.compile; torch.optim.AdamW(fused=True) for torchvision
  and timm, pycls's contiguous AdamW and torch's fused one for pycls);
- an ablation in the style of Meta's ViT speed-up chart, each row adding one change to the one
  before: fp32 baseline (class token, batch-first, torch.optim.AdamW with its per-parameter loop)
  -> +AMP -> +foreach optimizer (pycls AdamW, contiguous) -> +pooled classifier -> +batch-second
  -> +torch.compile -> +larger batch (2x).

It writes OUT/benchmark.md (tables), OUT/benchmark.json (rows) and OUT/benchmark.png (relative
throughput). TFLOP/s count 2 FLOPs per multiply-add and 3 passes per training step; MFU is against
the device's datasheet dense peak (CUDA only; empty on the CPU).

    python benchmarks/vs_libraries.py --arch vit_b16 --im-size 224 --batch-size 128 \
        --amp-dtype bfloat16
    python benchmarks/vs_libraries.py --tiny --batch-size 8 --iters 2 --warmup 1 --skip-compile \
        --out /tmp/b
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchvision.models.vision_transformer import VisionTransformer as TVViT  # noqa: E402

from pycls.core import benchmark as bench  # noqa: E402
from pycls.core import timing  # noqa: E402
from pycls.engines.base import Engine  # noqa: E402
from pycls.engines.precision import Precision  # noqa: E402
from pycls.models import VIT_SPECS, VisionTransformer, vit_complexity  # noqa: E402
from pycls.optim import AdamW, param_groups  # noqa: E402

# A 2-block, narrow model at 32 px: seconds on a CPU, for tests and smoke runs
TINY_SPEC = dict(patch_size=8, depth=2, width=64, num_heads=2, mlp_dim=128)
TIMM_NAMES = {
    "vit_ti16": "vit_tiny_patch16_224",
    "vit_s16": "vit_small_patch16_224",
    "vit_b16": "vit_base_patch16_224",
    "vit_b32": "vit_base_patch32_224",
    "vit_l16": "vit_large_patch16_224",
    "vit_h14": "vit_huge_patch14_224",
}
TV_NAMES = {"vit_b16": "vit_b_16", "vit_b32": "vit_b_32", "vit_l16": "vit_l_16"}
TV_NAMES["vit_h14"] = "vit_h_14"
WEIGHT_DECAY = 0.05
TABLES = ("libraries", "best", "ablation")
TITLES = {
    "libraries": "Libraries (relative to torchvision)",
    "best": "Libraries at their best settings (relative to torchvision)",
    "ablation": "Ablation (relative to the fp32 baseline)",
}


def parse_args(argv=None):
    # The whole docstring: its first paragraph alone stops mid-sentence
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="vit_b16", choices=sorted(VIT_SPECS), help="model size")
    p.add_argument("--im-size", type=int, default=224, help="image side in pixels")
    p.add_argument("--batch-size", type=int, default=128, help="images per training step")
    p.add_argument("--amp-dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--iters", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per row")
    p.add_argument("--out", default="/tmp/pycls_benchmark", help="output folder")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile rows")
    p.add_argument(
        "--tables", nargs="+", default=list(TABLES), choices=TABLES, help="tables to measure"
    )
    p.add_argument("--tiny", action="store_true", help=f"a tiny model at 32 px: {TINY_SPEC}")
    p.add_argument(
        "--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)"
    )
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ #
# Models and optimizers
# ------------------------------------------------------------------------------------------------ #


def model_spec(args):
    """VisionTransformer size arguments (patch, depth, width, heads, mlp) and image size."""
    spec = dict(TINY_SPEC) if args.tiny else dict(VIT_SPECS[args.arch])
    return spec, 32 if args.tiny else args.im_size


def pycls_model(args, classifier, layout):
    spec, size = model_spec(args)
    return VisionTransformer(
        image_size=size, num_classes=args.num_classes, classifier=classifier, layout=layout, **spec
    )


def torchvision_model(args):
    spec, size = model_spec(args)
    return TVViT(
        image_size=size,
        patch_size=spec["patch_size"],
        num_layers=spec["depth"],
        num_heads=spec["num_heads"],
        hidden_dim=spec["width"],
        mlp_dim=spec["mlp_dim"],
        num_classes=args.num_classes,
    )


def timm_model(args):
    """timm's ViT of the same size, or None when timm is not installed (it is optional)."""
    try:
        # optional: timm is a contender only where it is installed
        from timm.models.vision_transformer import VisionTransformer as TimmViT
    except ImportError:
        return None
    spec, size = model_spec(args)
    return TimmViT(
        img_size=size,
        patch_size=spec["patch_size"],
        embed_dim=spec["width"],
        depth=spec["depth"],
        num_heads=spec["num_heads"],
        mlp_ratio=spec["mlp_dim"] / spec["width"],
        num_classes=args.num_classes,
    )


def torch_adamw(model, foreach=None, fused=None):
    """torch.optim.AdamW over the same weight-decay groups (None: torch's default choice)."""
    groups = param_groups(model, WEIGHT_DECAY)
    return torch.optim.AdamW(groups, lr=1e-4, foreach=foreach, fused=fused)


def torch_fused_adamw(model):
    return torch_adamw(model, fused=True)


def pycls_adamw(model):
    return AdamW(param_groups(model, WEIGHT_DECAY), lr=1e-4, contiguous=True)


def flops_per_image(args, classifier):
    """Multiply-adds per image of the ViT at this size (the libraries' models are the same)."""
    spec, size = model_spec(args)
    return vit_complexity(
        image_size=size, num_classes=args.num_classes, classifier=classifier, **spec
    )["flops"]


# ------------------------------------------------------------------------------------------------ #
# Rows
# ------------------------------------------------------------------------------------------------ #


@dataclasses.dataclass
class Row:
    """One configuration to time: how to build its model and optimizer, and how to run it."""

    name: str
    table: str  # one of TABLES
    make_model: Callable[[], nn.Module | None]  # None: the library is not installed
    make_opt: Callable[[nn.Module], torch.optim.Optimizer]
    amp: str  # "O0" or "O1 <dtype>"
    classifier: str  # for the FLOP count
    compile: bool = False
    batch_factor: int = 1


def library_rows(args):
    """Same size, batch and precision; each library with the optimizer its users would take."""
    amp, default = f"O1 {args.amp_dtype}", "VisionTransformer (same size)"
    tv = default if args.tiny else TV_NAMES.get(args.arch, default)
    timm = default if args.tiny else TIMM_NAMES.get(args.arch, default)
    return [
        Row(f"torchvision {tv} + torch.optim.AdamW", "libraries",
            lambda: torchvision_model(args), torch_adamw, amp, "token"),
        Row(f"timm {timm} + torch.optim.AdamW", "libraries",
            lambda: timm_model(args), torch_adamw, amp, "token"),
        Row("pycls (class token, batch-first) + pycls AdamW", "libraries",
            lambda: pycls_model(args, "token", "batch_first"), pycls_adamw, amp, "token"),
        Row("pycls (pooled, batch-second) + pycls AdamW", "libraries",
            lambda: pycls_model(args, "pooled", "batch_second"), pycls_adamw, amp, "pooled"),
    ]  # fmt: skip


def best_rows(args):
    """Each library at its fastest: compiled, with a fused (or contiguous) optimizer."""
    amp, default = f"O1 {args.amp_dtype}", "VisionTransformer (same size)"
    tv = default if args.tiny else TV_NAMES.get(args.arch, default)
    timm = default if args.tiny else TIMM_NAMES.get(args.arch, default)

    def pooled():
        return pycls_model(args, "pooled", "batch_second")

    return [
        Row(f"torchvision {tv} + compile + AdamW(fused=True)", "best",
            lambda: torchvision_model(args), torch_fused_adamw, amp, "token", compile=True),
        Row(f"timm {timm} + compile + AdamW(fused=True)", "best",
            lambda: timm_model(args), torch_fused_adamw, amp, "token", compile=True),
        Row("pycls (pooled, batch-second) + compile + pycls AdamW (contiguous)", "best",
            pooled, pycls_adamw, amp, "pooled", compile=True),
        Row("pycls (pooled, batch-second) + compile + AdamW(fused=True)", "best",
            pooled, torch_fused_adamw, amp, "pooled", compile=True),
    ]  # fmt: skip


def ablation_rows(args):
    """Each row adds one change to the row before it."""
    amp = f"O1 {args.amp_dtype}"

    def loop_adamw(model):
        return torch_adamw(model, foreach=False)

    def vit(classifier, layout):
        return lambda: pycls_model(args, classifier, layout)

    token_first, pooled_first = vit("token", "batch_first"), vit("pooled", "batch_first")
    pooled_second = vit("pooled", "batch_second")
    compiled = not args.skip_compile
    return [
        Row("fp32 baseline (class token, batch-first, torch AdamW loop)", "ablation",
            token_first, loop_adamw, "O0", "token"),
        Row(f"+ AMP ({args.amp_dtype} autocast)", "ablation",
            token_first, loop_adamw, amp, "token"),
        Row("+ foreach optimizer (pycls AdamW, contiguous)", "ablation",
            token_first, pycls_adamw, amp, "token"),
        Row("+ pooled classifier", "ablation", pooled_first, pycls_adamw, amp, "pooled"),
        Row("+ batch-second layout", "ablation", pooled_second, pycls_adamw, amp, "pooled"),
        Row("+ torch.compile", "ablation", pooled_second, pycls_adamw, amp, "pooled",
            compile=True),
        Row("+ larger batch (2x)", "ablation", pooled_second, pycls_adamw, amp, "pooled",
            compile=compiled, batch_factor=2),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------ #
# Measurement
# ------------------------------------------------------------------------------------------------ #


def _precision(amp, device):
    """pycls Precision for "O0" or "O1 <dtype>" and a loss scaler for float16."""
    level, _, dtype = amp.partition(" ")
    return Precision(level, dtype or "bfloat16", device.type)


def _scaler(precision, device, is_pycls_opt):
    """torch's GradScaler for torch.optim (what its users run), pycls's for pycls's optimizer."""
    if not precision.uses_loss_scaling or is_pycls_opt:
        return precision.make_scaler(device)
    return torch.amp.GradScaler(device.type)


def measure(args, device, row):
    """One row's numbers: images/s, TFLOP/s, MFU, peak memory (or the reason it has none)."""
    if row.compile and args.skip_compile:
        return {"note": "skipped (--skip-compile)"}
    with device:  # initialised in place: a ViT-H/14 is slow to initialise on the host
        model = row.make_model()
    if model is None:
        return {"note": "timm not installed"}
    batch = args.batch_size * row.batch_factor
    precision = _precision(row.amp, device)
    model = precision.prepare_model(model.to(device)).train()
    optimizer = row.make_opt(model)
    scaler = _scaler(precision, device, isinstance(optimizer, AdamW))
    if row.compile:
        model = torch.compile(model)
    _, size = model_spec(args)
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, args.num_classes, (batch,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    engine = Engine(model, None, device, precision)  # the trainer's step on a plain model

    def step():
        optimizer.zero_grad(set_to_none=True)
        engine.forward_backward(images, labels, loss_fn, scaler)
        engine.step(optimizer, scaler)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # iters back-to-back steps, synchronised only at the ends: the host runs ahead as in training
    seconds = timing.time_calls(step, device, args.warmup, iters=1, group=args.iters).median
    tflops = 3 * 2 * flops_per_image(args, row.classifier) * batch / seconds / 1e12
    peak = bench.peak_tflops(device, _dtype_name(row.amp))
    cuda = device.type == "cuda"
    return {
        "amp": row.amp,
        "batch_size": batch,
        "step_ms": seconds * 1e3,
        "images_per_sec": batch / seconds,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }


def _dtype_name(amp):
    level, _, dtype = amp.partition(" ")
    if level != "O0":
        return dtype
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "float32"


def run_row(args, device, row):
    """measure() with out-of-memory and other failures recorded in the result, not fatal."""
    try:
        result = measure(args, device, row)
    except torch.OutOfMemoryError:
        result = {"note": "out of memory"}
    except Exception as e:  # a failing row (e.g. compile without a compiler) must not stop the rest
        result = {"note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    result.update(name=row.name, table=row.table, load=timing.load_average())
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if row.compile:
        torch._dynamo.reset()
    done = result.get("note") or f"{result['images_per_sec']:.1f} img/s"
    print(f"{row.name}: {done}", flush=True)
    return result


def add_relative(rows):
    """Speed relative to the first measured row of each table."""
    for table in TABLES:
        ref = next((r for r in rows if r["table"] == table and "images_per_sec" in r), None)
        for r in rows:
            if r["table"] == table and "images_per_sec" in r and ref is not None:
                r["relative"] = r["images_per_sec"] / ref["images_per_sec"]
    return rows


# ------------------------------------------------------------------------------------------------ #
# Output
# ------------------------------------------------------------------------------------------------ #


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def markdown(rows, header):
    """The two tables with the run's details above them."""
    lines = [f"- {k}: {v}" for k, v in header.items()] + [""]
    for table, title in TITLES.items():
        if not any(r["table"] == table for r in rows):
            continue
        lines += [f"**{title}**", ""]
        lines += [
            "| configuration | precision | batch | images/s | relative | TFLOP/s | MFU "
            "| peak mem (GiB) |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in rows if r["table"] == table):
            if "images_per_sec" not in r:
                lines.append(f"| {r['name']} | — | — | {r['note']} | — | — | — | — |")
                continue
            lines.append(
                f"| {r['name']} | {r['amp']} | {r['batch_size']} | {r['images_per_sec']:.1f} "
                f"| {r['relative']:.2f}x | {r['tflops']:.3g} | {_fmt(r['mfu'], '.1%')} "
                f"| {_fmt(r['peak_mem_gb'], '.2f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows, path):
    """Horizontal bars of relative throughput, one panel per table."""
    import matplotlib  # slow to import, needed only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    tables = [t for t in TABLES if any(r["table"] == t for r in rows)]
    heights = [sum(r["table"] == t for r in rows) for t in tables]
    fig, axes = plt.subplots(
        len(tables), 1, figsize=(9, 1 + sum(heights)), gridspec_kw={"height_ratios": heights}
    )
    for ax, table in zip(axes if len(tables) > 1 else [axes], tables):
        sel = [r for r in rows if r["table"] == table][::-1]
        values = [r.get("relative", 0.0) for r in sel]
        ax.barh([r["name"] for r in sel], values, color="#4c72b0")
        for y, (r, v) in enumerate(zip(sel, values)):
            ax.text(v, y, f" {v:.2f}x" if "relative" in r else f" {r['note']}", va="center")
        ax.set_title(table)
        ax.set_xlabel("throughput relative to the first row")
        ax.set_xlim(0, max(values + [1.0]) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cpu_name():
    """The CPU's model name and the threads torch uses."""
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        name = models[0] if models else name
    return f"{name}, torch threads: {torch.get_num_threads()}"


def device_header(args, device, argv):
    spec, size = model_spec(args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "date": datetime.date.today().isoformat(),
        "device": f"{device.type}: {name}",
        "torch": torch.__version__,
        "git": timing.source_revision(),
        "load average (1 min) at the start": _fmt(timing.load_average(), ".2f"),
        "command": "python benchmarks/vs_libraries.py " + " ".join(argv),
        "model": f"{'tiny' if args.tiny else args.arch} {spec} at {size} px",
        "measured matmul peak (TFLOP/s)": _fmt(
            timing.matmul_tflops(device, getattr(torch, args.amp_dtype)), ".1f"
        ),
    }


def write_results(rows, header, out):
    with open(os.path.join(out, "benchmark.md"), "w") as f:
        f.write(markdown(rows, header))
    with open(os.path.join(out, "benchmark.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer does for fp32 runs
    torch.backends.cudnn.allow_tf32 = True
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    builders = {"libraries": library_rows, "best": best_rows, "ablation": ablation_rows}
    todo = [row for table in TABLES if table in args.tables for row in builders[table](args)]
    os.makedirs(args.out, exist_ok=True)
    header = device_header(args, device, argv)
    rows = []
    for row in todo:
        rows.append(run_row(args, device, row))
        # after every row, so that a run stopped by a time limit keeps what it measured
        write_results(add_relative(rows), header, args.out)
    plot(rows, os.path.join(args.out, "benchmark.png"))
    print(markdown(rows, header))
    return rows


if __name__ == "__main__":
    main()
