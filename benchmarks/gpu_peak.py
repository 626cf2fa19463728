#!/usr/bin/env python3
"""The device's practical ceilings, and the optimizer step measured against its memory floor.

- matmul: achieved TFLOP/s of an N x N x N product (8192, bfloat16 by default; the median of the
  timed products on a GPU, the fastest on a CPU: pycls.core.timing.matmul_tflops), next to the
  datasheet's dense peak (pycls.core.benchmark.PEAK_TFLOPS);
- copy: device-to-device bandwidth of a large ``copy_`` (bytes read + bytes written per second);
- optimizer: one AdamW step over a ViT's parameters (ViT-H/14 by default) against the bandwidth
  floor, the bytes the update must move at least divided by the measured copy bandwidth:
  - fp32 weights, gradients and moments (AMP O0/O1): torch.optim.AdamW (fused, foreach) and
    pycls's AdamW (per-tensor foreach, contiguous buffers, the one compiled pass of
    OPTIM.ONE_PASS); floor 28 bytes per parameter (read weight, gradient, both moments; write
    weight and moments);
  - O2 (bfloat16 weights and gradients, norms fp32, fp32 master weights in the optimizer):
    pycls's contiguous AdamW with master weights and its one pass, without and with the EMA;
    floor 28 bytes per half parameter (read the fp32 master, both moments and the 2-byte
    gradient; write master, moments and the 2-byte weight), 8 more with the EMA (read and write
    its fp32 copy). The one pass also zeroes the gradient (4 or 2 bytes), which the other rows
    leave to the next step's ``zero_grad``: it counts in their time, not in the floor.

Writes OUT/gpu_peak.md and json_stats lines (``_type`` ``gpu_peak`` and ``optim_step``) to
OUT/stdout.log. On a machine without CUDA it runs the same code on the CPU (use --tiny there).

    python benchmarks/gpu_peak.py --out /tmp/gpu_peak
    python benchmarks/gpu_peak.py --tiny --out /tmp/gpu_peak_cpu
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pycls.core import benchmark as bench  # noqa: E402
from pycls.core import logging as logs  # noqa: E402
from pycls.core import timing  # noqa: E402
from pycls.core.ema import ModelEMA  # noqa: E402
from pycls.engines.precision import Precision  # noqa: E402
from pycls.models import VIT_SPECS, VisionTransformer  # noqa: E402
from pycls.optim import AdamW, OnePassAdamW, param_groups  # noqa: E402

# --tiny: sizes that take a second on one CPU thread
TINY = dict(matmul_n=256, copy_mib=16, arch_spec=dict(patch_size=8, depth=2, width=64,
            num_heads=2, mlp_dim=128), image_size=32)  # fmt: skip
WEIGHT_DECAY = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/pycls_gpu_peak", help="output folder")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--matmul-n", type=int, default=8192, help="side of the square matmul")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--copy-mib", type=int, default=2048, help="size of the copied buffer")
    p.add_argument("--arch", default="vit_h14", choices=sorted(VIT_SPECS), help="optimizer model")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per measurement")
    p.add_argument("--tiny", action="store_true", help=f"tiny sizes for a CPU rehearsal: {TINY}")
    p.add_argument(
        "--optimizers",
        nargs="*",
        default=list(ROWS),
        choices=list(ROWS),
        help="optimizer rows to measure (default: all; none: the ceilings only; those of the one "
        "pass compile first)",
    )
    return p.parse_args(argv)


def copy_gbps(device, mib, warmup, iters):
    """Device-to-device bandwidth in GB/s, counting the bytes read and the bytes written."""
    src = torch.empty(mib * 2**20 // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = timing.time_calls(lambda: dst.copy_(src), device, warmup, iters).median
    return 2 * src.nbytes / seconds / 1e9


def adamw_floor_bytes(params):
    """Least traffic of one AdamW update: read weight, gradient, exp_avg, exp_avg_sq; write the
    weight and both moments (the gradient and moments have the weight's dtype here)."""
    return sum(7 * p.numel() * p.element_size() for p in params)


def master_floor_bytes(params, ema=False):
    """Least traffic of one AdamW update with fp32 master weights (O2): per half parameter read
    the master, both moments (fp32) and the gradient, write the master, both moments and the half
    weight; an fp32 parameter (a norm) as ``adamw_floor_bytes``; with ``ema`` 8 bytes more per
    parameter (read and write its fp32 average)."""
    total = 0
    for p in params:
        per = 24 + 2 * p.element_size() if p.dtype in HALF else 7 * p.element_size()
        total += p.numel() * (per + (8 if ema else 0))
    return total


HALF = (torch.bfloat16, torch.float16)


def _one_pass_with_ema(model, groups):
    opt = OnePassAdamW(groups, master_weights=True)
    opt.attach_ema(ModelEMA(model), model)  # due at every step (period 1)
    return opt


# key -> (label, path, make(model, groups)); "fp32" rows run first, then the model is cast for O2
ROWS = {
    "torch_fused": ("torch.optim.AdamW(fused=True)", "fp32",
                    lambda m, g: torch.optim.AdamW(g, fused=True)),
    "torch_foreach": ("torch.optim.AdamW(foreach=True)", "fp32",
                      lambda m, g: torch.optim.AdamW(g, foreach=True)),
    "pycls_per_tensor": ("pycls AdamW (per-tensor foreach)", "fp32",
                         lambda m, g: AdamW(g, contiguous=False)),
    "pycls_contiguous": ("pycls AdamW (contiguous)", "fp32",
                         lambda m, g: AdamW(g, contiguous=True)),
    "pycls_one_pass": ("pycls AdamW one pass (OPTIM.ONE_PASS)", "fp32",
                       lambda m, g: OnePassAdamW(g)),
    "o2_contiguous": ("pycls AdamW (contiguous), O2 master weights", "O2",
                      lambda m, g: AdamW(g, contiguous=True, master_weights=True)),
    "o2_one_pass": ("pycls AdamW one pass, O2 master weights", "O2",
                    lambda m, g: OnePassAdamW(g, master_weights=True)),
    "o2_one_pass_ema": ("pycls AdamW one pass, O2 master weights + EMA", "O2 + EMA",
                        _one_pass_with_ema),
}  # fmt: skip


def optimizers(device, keys=tuple(ROWS)):
    """(key, label, path, factory) of the rows to measure, in run order: fp32 rows first (the
    contiguous modes last among them, since they turn the parameters into views of their flat
    buffers), then the O2 rows on the model cast to bfloat16."""
    fused = device.type == "cuda" or _fused_on_cpu()
    return [(k, *ROWS[k]) for k in ROWS if k in keys and (k != "torch_fused" or fused)]


def _fused_on_cpu():
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, ValueError):
        return False


def time_optimizer(model, make, device, warmup, iters):
    """Median seconds of one step over the model's weight-decay groups, gradients random."""
    opt = make(model, param_groups(model, WEIGHT_DECAY))
    opt.zero_grad(set_to_none=False)  # contiguous mode: gradient views of its flat buffer
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_(std=1e-3)
    seconds = timing.time_calls(opt.step, device, warmup, iters).median
    del opt
    return seconds


def floor_of(path, params):
    if path == "fp32":
        return adamw_floor_bytes(params)
    return master_floor_bytes(params, ema=path.endswith("EMA"))


def cast_for_o2(model):
    """The model as AMP level O2 holds it (bfloat16 but the norms), gradients dropped."""
    for p in model.parameters():
        p.grad = None
    return Precision("O2", "bfloat16").prepare_model(model)


def build_model(args, device):
    spec = dict(TINY["arch_spec"]) if args.tiny else dict(VIT_SPECS[args.arch])
    size = TINY["image_size"] if args.tiny else 224
    with torch.device(device):  # built in place: no 2.5 GB copy from the host for ViT-H/14
        return VisionTransformer(image_size=size, num_classes=1000, **spec)


def main(argv=None):
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    logs.setup_logging(args.out)
    n = TINY["matmul_n"] if args.tiny else args.matmul_n
    mib = TINY["copy_mib"] if args.tiny else args.copy_mib
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    tflops = timing.matmul_tflops(device, dtype, n, args.warmup, args.iters)
    peak = bench.peak_tflops(device, args.dtype)
    gbps = copy_gbps(device, mib, args.warmup, args.iters)
    peak_stats = {
        "_type": "gpu_peak", "device": name, "torch": torch.__version__,
        "revision": timing.source_revision(), "load": timing.load_average(),
        "matmul_n": n, "matmul_dtype": args.dtype, "matmul_tflops": tflops,
        "datasheet_tflops": peak, "matmul_vs_datasheet": tflops / peak if peak else None,
        "copy_mib": mib, "copy_gbps": gbps,
    }  # fmt: skip
    logs.log_json_stats(peak_stats)

    todo = optimizers(device, args.optimizers)
    model = build_model(args, device) if todo else None  # --optimizers alone: the ceilings only
    rows = []
    for key, label, path, make in todo:
        if path != "fp32" and any(p.dtype == torch.float32 for p in model.parameters()
                                  if p.ndim > 1):  # fmt: skip
            model = cast_for_o2(model)
        params = [p for p in model.parameters() if p.requires_grad]
        floor_bytes = floor_of(path, params)
        floor_s = floor_bytes / (gbps * 1e9)
        try:
            seconds = time_optimizer(model, make, device, args.warmup, args.iters)
            note = ""
        except torch.OutOfMemoryError:
            seconds, note = None, "out of memory"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        stats = {
            "_type": "optim_step", "optimizer": label, "key": key, "path": path,
            "arch": "tiny" if args.tiny else args.arch,
            "params": sum(p.numel() for p in params), "step_ms": seconds and seconds * 1e3,
            "floor_ms": floor_s * 1e3, "floor_bytes": floor_bytes,
            "floor_bytes_per_param": floor_bytes / sum(p.numel() for p in params),
            "ratio_to_floor": seconds / floor_s if seconds else None,
            "achieved_gbps": floor_bytes / seconds / 1e9 if seconds else None, "note": note,
        }  # fmt: skip
        logs.log_json_stats(stats)
        rows.append(stats)
    table = markdown(peak_stats, rows)
    with open(os.path.join(args.out, "gpu_peak.md"), "w") as f:
        f.write(table)
    print(table)
    return peak_stats, rows


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def markdown(peak, rows):
    lines = [
        f"- device: {peak['device']}, torch {peak['torch']}, revision {peak['revision']}, load "
        f"average (1 min) {_fmt(peak['load'], '.2f')}",
        f"- matmul {peak['matmul_n']}^3 {peak['matmul_dtype']}: {peak['matmul_tflops']:.4g} "
        f"TFLOP/s (datasheet {_fmt(peak['datasheet_tflops'], '.1f')}, "
        f"{_fmt(peak['matmul_vs_datasheet'], '.1%')} of it)",
        f"- device-to-device copy of {peak['copy_mib']} MiB: {peak['copy_gbps']:.4g} GB/s "
        "(read + written)",
    ]
    if not rows:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"AdamW step over {rows[0]['arch']} ({rows[0]['params'] / 1e6:.1f} M parameters); "
        "floor: the bytes the update must move at least (per parameter in the table) at the copy "
        "bandwidth",
        "",
        "| optimizer | path | floor B/param | floor ms | step ms | x floor | achieved GB/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        note = f" {r['note']}" if r["note"] else ""
        lines.append(
            f"| {r['optimizer']} | {r['path']} | {r['floor_bytes_per_param']:.1f} "
            f"| {r['floor_ms']:.3g} | {_fmt(r['step_ms'], '.3g')}{note} "
            f"| {_fmt(r['ratio_to_floor'], '.2f')} | {_fmt(r['achieved_gbps'], '.4g')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
