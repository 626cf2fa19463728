#!/usr/bin/env python3
"""scaled_dot_product_attention's backends at the shapes of ViT training steps.

For each shape (ViT-B/16 and ViT-L/16: 197 tokens of 64-wide heads, 12 and 16 heads; ViT-H/14: 257
tokens, 16 heads of 80), forward and forward + backward, in bfloat16 by default:

- each backend forced alone (``torch.nn.attention.sdpa_kernel``): cuDNN, FlashAttention-2
  ("flash"), memory-efficient ("efficient") and the unfused reference ("math"); a backend that
  cannot run the shape here says so;
- torch's own choice ("default"), and which backend that is: the ATen operator the default call
  runs (``aten::_scaled_dot_product_cudnn_attention``, ``..._flash_attention``,
  ``..._efficient_attention``, ``..._flash_attention_for_cpu``, ``..._attention_math``), read from
  a torch.profiler trace of one call.

TFLOP/s count the two matrix products of the forward pass (QKᵀ and AV: 4·B·H·N²·D FLOPs) and
twice that for the backward pass (4 products), as a training step's FLOPs count its passes; a
backend that recomputes QKᵀ in its backward pass does more work than it is credited with.

Writes OUT/attention.md and OUT/attention.json after every row (a run stopped by a time limit keeps
what it measured). On a CPU, ``--tiny`` shapes rehearse it (math and the CPU's flash kernel).

    python benchmarks/attention_backends.py --out /tmp/attention
    python benchmarks/attention_backends.py --tiny --out /tmp/attention_cpu
"""

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from pycls.core import timing  # noqa: E402

# name -> (batch, heads, tokens, head dim): the attention of each model's training step
SHAPES = {
    "vit_b16": (256, 12, 197, 64),
    "vit_l16": (128, 16, 197, 64),
    "vit_h14": (64, 16, 257, 80),
}
TINY_SHAPES = {"tiny_b": (2, 2, 17, 16), "tiny_h": (2, 2, 21, 20)}
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# The ATen operator each backend runs, as the profiler names it
OPERATORS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
}
PASSES = ("forward", "forward+backward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="/tmp/pycls_attention", help="output folder")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                   help="model shapes to measure")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="calls per timed sample (back to back)")
    p.add_argument("--samples", type=int, default=5, help="timed samples (their median counts)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    p.add_argument("--tiny", action="store_true", help=f"tiny shapes for a CPU: {TINY_SHAPES}")
    return p.parse_args(argv)


def attention_flops(shape, passes):
    """FLOPs of the attention's matrix products: 4·B·H·N²·D forward, 8·B·H·N²·D backward."""
    b, h, n, d = shape
    forward = 4 * b * h * n * n * d
    return forward if passes == "forward" else 3 * forward


def inputs(shape, dtype, device, grad):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(shape, dtype=dtype, device=device, generator=gen).requires_grad_(grad)
        for _ in range(3)
    )
    return q, k, v


def call_of(shape, dtype, device, passes):
    """A function running one forward (or forward + backward) attention call."""
    q, k, v = inputs(shape, dtype, device, passes != "forward")
    if passes == "forward":

        @torch.no_grad()
        def forward():
            F.scaled_dot_product_attention(q, k, v)

        return forward
    grad_out = torch.randn_like(q)

    def forward_backward():
        out = F.scaled_dot_product_attention(q, k, v)
        q.grad = k.grad = v.grad = None
        out.backward(grad_out)

    return forward_backward


def default_backend(fn):
    """The backend torch picks, from the ATen operator one call runs (a profiler trace)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    found = [label for op, label in OPERATORS.items() if op in names]
    return (
        found[0]
        if found
        else "unknown ("
        + ", ".join(sorted(n for n in names if "sdp" in n or "attention" in n))[:80]
        + ")"
    )


def measure(args, device, dtype, name, shape, passes, backend):
    """One row: the median seconds per call (samples of back-to-back calls) and TFLOP/s."""
    fn = call_of(shape, dtype, device, passes)
    row = {"shape": name, "dims": list(shape), "pass": passes, "backend": backend}
    try:
        if backend == "default":
            row["picks"] = default_backend(fn)
            seconds = timing.time_calls(fn, device, args.warmup, args.samples, group=args.iters)
        else:
            with sdpa_kernel(BACKENDS[backend]):
                seconds = timing.time_calls(fn, device, args.warmup, args.samples, group=args.iters)
    except RuntimeError as e:  # this backend cannot run this shape, dtype or device
        row["note"] = "unsupported here: " + str(e).splitlines()[0][:60]
        return row
    row["ms"] = seconds.median * 1e3
    row["tflops"] = attention_flops(shape, passes) / seconds.median / 1e12
    return row


def markdown(header, rows):
    lines = [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += [
        "| shape (B, H, N, D) | pass | backend | ms | TFLOP/s | vs default |",
        "|---|---|---|---:|---:|---:|",
    ]
    default = {(r["shape"], r["pass"]): r for r in rows if r["backend"] == "default"}
    for r in rows:
        shape = f"{r['shape']} {tuple(r['dims'])}"
        backend = r["backend"] + (f" (picks {r['picks']})" if "picks" in r else "")
        if "ms" not in r:
            lines.append(f"| {shape} | {r['pass']} | {backend} | {r['note']} | — | — |")
            continue
        ref = default.get((r["shape"], r["pass"]), {}).get("ms")
        rel = f"{ref / r['ms']:.2f}x" if ref else "—"
        lines.append(
            f"| {shape} | {r['pass']} | {backend} | {r['ms']:.3f} | {r['tflops']:.4g} | {rel} |"
        )
    return "\n".join(lines) + "\n"


def write(out, header, rows):
    with open(os.path.join(out, "attention.md"), "w") as f:
        f.write(markdown(header, rows))
    with open(os.path.join(out, "attention.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    shapes = TINY_SHAPES if args.tiny else {k: SHAPES[k] for k in args.shapes}
    os.makedirs(args.out, exist_ok=True)
    header = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "git": timing.source_revision(),
        "load average (1 min)": timing.load_average(),
        "dtype": args.dtype,
        "command": "python benchmarks/attention_backends.py " + " ".join(argv),
    }
    rows = []
    for name, shape in shapes.items():
        for passes in PASSES:
            for backend in ("default", *BACKENDS):
                row = measure(args, device, dtype, name, shape, passes, backend)
                rows.append(row)
                write(args.out, header, rows)
                done = row.get("note") or f"{row['ms']:.3f} ms, {row['tflops']:.4g} TFLOP/s"
                print(f"{name} {passes} {backend}: {done}", flush=True)
    print(markdown(header, rows))
    return rows


if __name__ == "__main__":
    main()
