#!/usr/bin/env python3
"""A/B of training-step variants of one config, in one process, and timm's ViT doing the same work.

Each variant is the config (``--cfg``, ``--opts`` for every variant) with its own KEY VALUE
overrides (``--variant NAME "KEY VALUE ..."``, repeatable; the first is the baseline). Each is
built once, as ``--mode time`` builds it (the trainer's own step on synthetic batches already on
the device: learning rate, forward, loss, backward, clipping, optimizer, EMA, mixup as the config
has them), compiled as its config says, and warmed up; then every variant takes one turn per round
(``--rounds``, the order rotating; built in the order: the baseline, the libraries, the other
variants, so that a deadline cuts levers before the comparison), each turn ``--iters`` steps
back to back with the device synchronised only at the two ends (pycls.core.timing), as training
runs them.

``--timm`` adds timm's VisionTransformer of the same size (``vit_base_patch16_224`` for ViT-B/16)
at its best: ``torch.compile`` of the whole model when the config compiles, bf16 autocast,
``torch.optim.AdamW(fused=True)`` on CUDA, and the same work as pycls's step: with ``--work
recipe`` (the default) the config's drop path (``drop_path_rate``), EMA (``timm.utils.ModelEmaV3``),
gradient clipping and mixup / cutmix (``timm.data.Mixup`` with soft-target cross-entropy); with
``--work off`` all of them off on both sides (the variants get VIT.DROP_PATH 0, TRAIN.EMA False,
OPTIM.CLIP_GRAD 0, MIXUP.ALPHA 0, MIXUP.CUTMIX_ALPHA 0). ``--torchvision`` adds torchvision's
ViT (``vit_b_16``) the same way, with its reference script's EMA and MixUp / CutMix; it has no
drop path, which its row says.

Per variant: compile seconds (dynamo's account) and the first step's wall time, graphs compiled
for the model (the one-pass optimizer's own graphs apart), blocks that ran eager, images/s (the
median of the rounds), the ratio to the baseline (pooled medians, and per round with quartiles),
MFU against the datasheet peak and against the matmul measured here, peak memory (of the process:
the variants built before it stay resident), and a verdict: a variant "wins" when it is at least
3 % faster than the baseline with every block compiled and at most 2 graphs. A variant whose
overrides change the model (a VIT key that shapes it: the parallel block, bias-free layers) says
so in its verdict, and is left out of the best variant compared with the libraries (they do
the baseline's work). ``--profile NAME``
profiles 5 steps of a variant (torch.profiler) summed into categories: GEMM, attention,
element-wise, optimizer, copies, idle.

``--deadline-s`` bounds the whole run: what does not fit is skipped, saying so. OUT/step_ab.md and
OUT/step_ab.json are rewritten after every variant and every round, so a run stopped at its limit
keeps what it measured.

    python benchmarks/step_ab.py --cfg configs/vit_b16.yaml --opts "TRAIN.BATCH_SIZE 256 \\
        TRAIN.COMPILE True OPTIM.CONTIGUOUS_PARAMS True" --variant o1 "AMP.LEVEL O1" \\
        --variant o2 "AMP.LEVEL O2" --timm --out /tmp/ab
    python benchmarks/step_ab.py --cfg configs/vit_b16.yaml --tiny --variant a "" \\
        --variant b "OPTIM.CONTIGUOUS_PARAMS True" --timm --rounds 2 --iters 2 --out /tmp/ab_cpu
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import shlex
import sys
from collections.abc import Callable

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCHMARKS))
sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402
from profile_step import merged_busy_us  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from pycls import config  # noqa: E402
from pycls.core import benchmark as bench  # noqa: E402
from pycls.core import builders, compile_stats, timing, token_costs  # noqa: E402
from pycls.core.trainer import setup_env  # noqa: E402
from pycls.models import vit_complexity  # noqa: E402
from pycls.models.vit.args import TRAINING_ONLY_ARGS  # noqa: E402
from pycls.optim import one_pass, param_groups  # noqa: E402

SYNTHETIC = ["TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic"]
# --work off: the recipe's extra work, off
WORK_OFF = ["VIT.DROP_PATH", "0.0", "TRAIN.EMA", "False", "OPTIM.CLIP_GRAD", "0.0",
            "MIXUP.ALPHA", "0.0", "MIXUP.CUTMIX_ALPHA", "0.0"]  # fmt: skip
# --tiny: a 2-block, 64-wide ViT (ViT-Ti's shape, narrower) at 32 px on the CPU, for rehearsals
TINY = ["MODEL.ARCH", "", "VIT.PATCH_SIZE", "8", "VIT.DEPTH", "2", "VIT.WIDTH", "64",
        "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "128", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "32",
        "TRAIN.BATCH_SIZE", "8", "DEVICE", "cpu", "DATA_LOADER.NUM_WORKERS", "0"]  # fmt: skip
TIMM_NAMES = {  # (patch, depth, width, heads, mlp) -> the timm model of that size
    (16, 12, 768, 12, 3072): "vit_base_patch16_224",
    (16, 24, 1024, 16, 4096): "vit_large_patch16_224",
    (14, 32, 1280, 16, 5120): "vit_huge_patch14_224",
}
TORCHVISION_NAMES = {
    (16, 12, 768, 12, 3072): "vit_b_16",
    (16, 24, 1024, 16, 4096): "vit_l_16",
    (14, 32, 1280, 16, 5120): "vit_h_14",
}
WIN = 1.03  # a lever wins at 3 % or more
MAX_GRAPHS = 2
# profile categories, from kernel (or, on a CPU, operator) names; the first that matches wins
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::linear", "matmul")),
    ("copies", ("memcpy", "memset", "copy", "aten::to", "aten::_to_copy")),
)  # fmt: skip
OPTIMIZER_RANGE = "step_ab.optimizer"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cfg", required=True, help="the config every variant starts from")
    p.add_argument("--opts", default="", help='"KEY VALUE ..." overrides for every variant')
    p.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "OPTS"), default=[],
                   help='a variant: its name and its "KEY VALUE ..." overrides (the first is '
                   "the baseline)")  # fmt: skip
    p.add_argument("--timm", action="store_true", help="add timm's ViT of the same size")
    p.add_argument("--torchvision", action="store_true",
                   help="add torchvision's ViT of the same size")  # fmt: skip
    work = "besides forward, backward and AdamW: the config's drop path, EMA, clipping, mixup"
    p.add_argument("--work", default="recipe", choices=("recipe", "off"),
                   help=f"what both sides do {work} (recipe), or none of them (off)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="turns each variant takes")
    p.add_argument("--iters", type=int, default=10, help="steps per turn, back to back")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after building (compile)")
    p.add_argument("--deadline-s", type=float, help="time limit of the whole run (seconds)")
    p.add_argument("--profile", nargs="*", default=[], metavar="NAME",
                   help="variants to profile (5 steps, by category)")  # fmt: skip
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a tiny ViT on the CPU (rehearsal)")
    p.add_argument("--out", default="/tmp/pycls_step_ab", help="output folder")
    args = p.parse_args(argv)
    if not args.variant:
        p.error("give at least one --variant NAME OPTS")
    names = [n for n, _ in args.variant] + [k for k in LIBRARIES if getattr(args, k)]
    if len(set(names)) != len(names):
        p.error(f"variant names must differ (timm and torchvision are the libraries'): {names}")
    unknown = set(args.profile) - set(names)
    if unknown:
        p.error(f"--profile: no variant {sorted(unknown)}")
    return args


# ------------------------------------------------------------------------------------------------ #
# Contenders
# ------------------------------------------------------------------------------------------------ #


@dataclasses.dataclass
class Contender:
    """One variant, built: how to run one step and what a step computes."""

    name: str
    kind: str  # "pycls" or "timm"
    step: Callable[[], object]
    batch: int  # images per step
    flops_per_step: float  # FLOPs (2 per multiply-add), forward + backward
    dtype_name: str  # the matmuls' dtype, for the datasheet peak
    compiled: bool
    overrides: str
    probe: object = None  # a compile_stats.EagerBlockProbe
    num_blocks: int = 0
    optimizer: object = None
    model: object = None
    shape: object = None  # the model's arguments that shape it (a ViT's), to tell another model


def variant_config(args, name, opts):
    tiny = TINY if args.tiny else []  # last: a rehearsal stays tiny whatever the options say
    work = WORK_OFF if args.work == "off" else []
    out = ["OUT_DIR", os.path.join(args.out, "variants", name)]
    overrides = SYNTHETIC + shlex.split(args.opts) + work + shlex.split(opts) + tiny + out
    return config.load_cfg(args.cfg, overrides)


def build_pycls(args, name, opts):
    """The trainer's own step of one variant, compiled as its config says."""
    cfg = variant_config(args, name, opts)
    device = setup_env(cfg)
    _, run, parts = bench.synthetic_training(cfg, device)
    engine, optimizer, _, _, precision, (images, _) = parts
    blocks = bench.repeated_blocks(engine.module)
    engine.compile()
    flops = token_costs.flops_per_image(engine.module, images, cfg.TRAIN.IM_SIZE, training=True)
    batch = images.shape[0] * cfg.TRAIN.ACCUM_STEPS
    arch = getattr(engine.module, "arch", None)  # a ViT's arguments
    shape = arch and {k: v for k, v in arch.items() if k not in TRAINING_ONLY_ARGS}
    return Contender(
        name, "pycls", run, batch, 3 * 2 * flops * batch, bench.compute_dtype_name(precision),
        cfg.TRAIN.COMPILE, opts, compile_stats.EagerBlockProbe(blocks), len(blocks), optimizer,
        engine.module, shape,
    ), cfg, device  # fmt: skip


def timm_name(cfg, names):
    """The library's name for a ViT of the config's size (``names``: TIMM_NAMES or
    TORCHVISION_NAMES), or a description."""
    v = cfg.VIT
    key = (v.PATCH_SIZE, v.DEPTH, v.WIDTH, v.NUM_HEADS, v.MLP_DIM)
    known = names.get(key) if cfg.TRAIN.IM_SIZE == 224 else None
    return known or "VisionTransformer (the same size)"


def build_timm(args, cfg, device):
    """timm's ViT of the config's size at its best, doing the same work (``--work``): drop path
    as ``drop_path_rate``, timm's ModelEmaV3, timm's Mixup with soft-target cross-entropy."""
    from timm.data import Mixup  # optional: timm is a contender only where it is installed
    from timm.loss import SoftTargetCrossEntropy  # (optional)
    from timm.models.vision_transformer import VisionTransformer  # (optional)
    from timm.utils import ModelEmaV3  # (optional)

    v, t, m = cfg.VIT, cfg.TRAIN, cfg.MIXUP
    recipe = args.work == "recipe"
    torch.manual_seed(cfg.RNG_SEED)
    with device:
        model = VisionTransformer(
            img_size=t.IM_SIZE, patch_size=v.PATCH_SIZE, embed_dim=v.WIDTH, depth=v.DEPTH,
            num_heads=v.NUM_HEADS, mlp_ratio=v.MLP_DIM / v.WIDTH,
            num_classes=cfg.MODEL.NUM_CLASSES, drop_path_rate=v.DROP_PATH if recipe else 0.0,
        )  # fmt: skip
    ema = ModelEmaV3(model, decay=t.EMA_DECAY) if recipe and t.EMA else None
    counter = [0]

    def average():
        counter[0] += 1
        ema.update(model, step=counter[0])

    mixer = None
    if recipe and (m.ALPHA > 0 or m.CUTMIX_ALPHA > 0):
        mixer = Mixup(mixup_alpha=m.ALPHA, cutmix_alpha=m.CUTMIX_ALPHA, prob=m.PROB,
                      switch_prob=m.SWITCH_PROB, label_smoothing=t.LABEL_SMOOTHING,
                      num_classes=cfg.MODEL.NUM_CLASSES)  # fmt: skip
    loss_fn = SoftTargetCrossEntropy() if mixer else None
    name = timm_name(cfg, TIMM_NAMES)
    return library_contender(
        "timm", name, args, cfg, device, model, average if ema else None, mixer, loss_fn
    )


def build_torchvision(args, cfg, device):
    """torchvision's ViT of the config's size at its best, doing the same work as far as it can:
    its reference script's EMA (``AveragedModel`` with an EMA average) and MixUp / CutMix
    (transforms v2); it has no drop path (stochastic depth), which the row says."""
    v, t, m = cfg.VIT, cfg.TRAIN, cfg.MIXUP
    recipe = args.work == "recipe"
    torch.manual_seed(cfg.RNG_SEED)
    with device:
        model = TorchvisionViT(
            image_size=t.IM_SIZE, patch_size=v.PATCH_SIZE, num_layers=v.DEPTH,
            num_heads=v.NUM_HEADS, hidden_dim=v.WIDTH, mlp_dim=v.MLP_DIM,
            num_classes=cfg.MODEL.NUM_CLASSES,
        )  # fmt: skip
    ema = None
    if recipe and t.EMA:
        multi_avg = torch.optim.swa_utils.get_ema_multi_avg_fn(t.EMA_DECAY)
        ema = torch.optim.swa_utils.AveragedModel(model, device, multi_avg_fn=multi_avg)
    mixes = []
    if recipe and m.ALPHA > 0:
        mixes.append(v2.MixUp(alpha=m.ALPHA, num_classes=cfg.MODEL.NUM_CLASSES))
    if recipe and m.CUTMIX_ALPHA > 0:
        mixes.append(v2.CutMix(alpha=m.CUTMIX_ALPHA, num_classes=cfg.MODEL.NUM_CLASSES))
    mixer = v2.RandomChoice(mixes) if mixes else None
    name = timm_name(cfg, TORCHVISION_NAMES)
    if recipe and v.DROP_PATH > 0:
        name += f" (no drop path: torchvision's ViT has none; the config's is {v.DROP_PATH})"
    average = (lambda: ema.update_parameters(model)) if ema else None
    return library_contender("torchvision", name, args, cfg, device, model, average, mixer, None)


def library_contender(kind, name, args, cfg, device, model, average, mixer, loss_fn):
    """A library's step as its users write it: autocast, the loss in fp32, backward, clipping,
    ``torch.optim.AdamW`` (fused on CUDA) over weight-decay groups, the EMA; the whole model
    compiled when the config compiles."""
    t, o = cfg.TRAIN, cfg.OPTIM
    recipe = args.work == "recipe"
    model.train()
    cuda = device.type == "cuda"
    groups = param_groups(model, o.WEIGHT_DECAY, o.WEIGHT_DECAY_NO_DECAY_GROUP)
    opt = torch.optim.AdamW(groups, lr=o.BASE_LR, betas=tuple(o.BETAS), eps=o.EPS,
                            fused=True if cuda else None)  # fmt: skip
    loss_fn = loss_fn or torch.nn.CrossEntropyLoss(label_smoothing=t.LABEL_SMOOTHING)
    clip = o.CLIP_GRAD if recipe else 0.0
    step_model = torch.compile(model) if t.COMPILE else model
    amp = cfg.AMP.LEVEL != "O0"
    dtype = getattr(torch, cfg.AMP.DTYPE)
    images, labels = bench.synthetic_micro_batch(cfg, device)

    def step():
        x, y = mixer(images, labels) if mixer else (images, labels)
        with torch.autocast(device.type, dtype=dtype, enabled=amp):
            out = step_model(x)
        loss = loss_fn(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        if average is not None:
            average()
        return loss

    v = cfg.VIT
    flops = vit_complexity(
        image_size=t.IM_SIZE, patch_size=v.PATCH_SIZE, depth=v.DEPTH, width=v.WIDTH,
        num_heads=v.NUM_HEADS, mlp_dim=v.MLP_DIM, num_classes=cfg.MODEL.NUM_CLASSES,
        classifier="token",
    )["flops"]  # fmt: skip
    batch = images.shape[0]
    dtype_name = bench.compute_dtype_name(builders.build_precision(cfg, device))
    what = f"{name}, compile {t.COMPILE}, AdamW(fused={cuda}), work {args.work}"
    return Contender(kind, kind, step, batch, 3 * 2 * flops * batch, dtype_name, t.COMPILE,
                     what, None, v.DEPTH, opt, model)  # fmt: skip


LIBRARIES = {"timm": build_timm, "torchvision": build_torchvision}  # the contenders, in order


# ------------------------------------------------------------------------------------------------ #
# Measuring
# ------------------------------------------------------------------------------------------------ #


def warm(c, args, device):
    """Warm-up steps (the first one compiles): what compiling took and made, and the memory."""
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        resident = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    before, optimizer_graphs = (
        compile_stats.snapshot(),
        compile_stats.cached_graphs(one_pass.adamw_pass),
    )
    first = timing.time_calls(c.step, device, 0, 1).times[0]
    timing.warm_up(c.step, max(args.warmup - 1, 0))
    timing.sync(device)
    stats = compile_stats.delta(before, compile_stats.snapshot())
    fields, warning = compile_stats.report(stats, c.probe, c.num_blocks, c.compiled)
    opt_graphs = compile_stats.cached_graphs(one_pass.adamw_pass)
    opt_new = (opt_graphs or 0) - (optimizer_graphs or 0)
    fields.update(
        first_step_s=first,
        optimizer_graphs=opt_new,
        model_graphs=fields["unique_graphs"] - opt_new,
        resident_gb=resident / 2**30 if cuda else None,
        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    )
    return fields, warning


def verdict(row, baseline):
    if row["name"] == baseline:
        return "baseline"
    if row.get("kind") in LIBRARIES:
        return "contender"
    if "speedup" not in row:
        return "—"
    if row.get("uncompiled"):
        return f"not comparable: ran eager ({row.get('eager_blocks')} blocks)"
    if row["compiled"] and row["model_graphs"] > MAX_GRAPHS:
        return f"not comparable: {row['model_graphs']} graphs"
    gain = row["speedup"] - 1
    said = f"wins ({gain:+.1%})" if row["speedup"] >= WIN else f"no win ({gain:+.1%})"
    return said if row.get("same_model", True) else f"{said}, another model"


def summarize(rows, rounds, baseline, peak, measured):
    """Throughput, ratios and MFU of every measured row, from the rounds so far."""
    times = {name: [r for r in per if r is not None] for name, per in rounds.items()}
    base = times.get(baseline) or []
    for row in rows:
        own = times.get(row["name"]) or []
        if not own:
            continue
        t = timing.Timing(tuple(own))
        row.update(step_ms=t.median * 1e3, images_per_sec=row["batch"] / t.median)
        achieved = row["flops_per_step"] / t.median / 1e12
        row.update(tflops=achieved, mfu=achieved / peak if peak else None,
                   mfu_vs_matmul=achieved / measured if measured else None)  # fmt: skip
        n = min(len(own), len(base))
        if base and row["name"] != baseline and n:
            ratio = timing.ratio([[b] for b in base[:n]], [[a] for a in own[:n]])
            row.update(speedup=ratio.of_medians, speedup_q1=ratio.q1, speedup_q3=ratio.q3)
        row["verdict"] = verdict(row, baseline)
    valid = [
        r
        for r in rows
        if r.get("kind") == "pycls"
        and "images_per_sec" in r
        and not r.get("uncompiled")
        and not r.get("verdict", "").startswith("not comp")
        and r.get("same_model", True)
    ]
    best = max(valid, key=lambda r: r["images_per_sec"]) if valid else None
    versus = {}
    for lib in LIBRARIES:
        other = next((r for r in rows if r.get("kind") == lib and "images_per_sec" in r), None)
        if best and other:
            ratio = best["images_per_sec"] / other["images_per_sec"]
            versus[lib] = {"best": best["name"], "ratio": ratio}
    return versus


# ------------------------------------------------------------------------------------------------ #
# Profile by category
# ------------------------------------------------------------------------------------------------ #


def category(name):
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "element-wise"


def profile(c, steps, device):
    """``steps`` steps under torch.profiler: milliseconds per step by category (GPU kernels on
    CUDA, else the CPU's operators by self time), the optimizer's part read from a range around
    its step."""
    opt = c.optimizer
    step_fn = opt.step

    def annotated(*a, **kw):
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            return step_fn(*a, **kw)

    opt.step = annotated
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    try:
        timing.sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            wall = timing.time_calls(c.step, device, 0, 1, group=steps).median * steps
    finally:
        del opt.step  # the bound method again
    return (_gpu_categories if cuda else _cpu_categories)(prof, steps, wall)


def _gpu_categories(prof, steps, wall):
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == OPTIMIZER_RANGE]
    kernels = [e for e in events if e.name != OPTIMIZER_RANGE]
    totals = {}
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        inside = any(s <= start and end <= t for s, t in ranges)
        label = "optimizer" if inside else category(e.name)
        totals[label] = totals.get(label, 0.0) + (end - start)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    window = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    totals["idle"] = max(window - merged_busy_us(spans), 0.0)
    return {k: v / steps / 1e3 for k, v in totals.items()} | {"wall_ms": wall / steps * 1e3}


def _cpu_categories(prof, steps, wall):
    totals = {}
    for e in prof.events():
        if e.name == OPTIMIZER_RANGE:
            continue
        parent, inside = e.cpu_parent, False
        while parent is not None and not inside:
            inside, parent = parent.name == OPTIMIZER_RANGE, parent.cpu_parent
        label = "optimizer" if inside else category(e.name)
        totals[label] = totals.get(label, 0.0) + e.self_cpu_time_total
    busy = sum(totals.values()) / 1e3
    out = {k: v / steps / 1e3 for k, v in totals.items()}
    out["idle"] = max(wall * 1e3 - busy, 0.0) / steps
    return out | {"wall_ms": wall / steps * 1e3}


# ------------------------------------------------------------------------------------------------ #
# Output
# ------------------------------------------------------------------------------------------------ #


def _fmt(value, spec, none="—"):
    return none if value is None else format(value, spec)


def markdown(header, rows, versus, profiles):
    lines = [f"- {k}: {v}" for k, v in header.items()]
    for lib, vs in (versus or {}).items():
        lines.append(f"- best pycls variant ({vs['best']}) vs {lib}: {vs['ratio']:.3f}x")
    lines += [
        "",
        "| variant | overrides | compile s (first step s) | graphs | eager blocks | images/s "
        "| ms/step | vs baseline (per-round quartiles) | MFU | MFU vs matmul | peak GiB "
        "| verdict |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['name']} | `{r['overrides']}` | {r['note']} |" + " — |" * 9)
            continue
        graphs = f"{r['model_graphs']}" + (
            f" (+{r['optimizer_graphs']} optimizer)" if r.get("optimizer_graphs") else ""
        )
        eager = (
            "—" if r.get("eager_blocks") is None else f"{r['eager_blocks']} of {r['num_blocks']}"
        )
        vs = "—"
        if "speedup" in r:
            vs = f"{r['speedup']:.3f}x ({r['speedup_q1']:.3f}-{r['speedup_q3']:.3f})"
        lines.append(
            f"| {r['name']} | `{r['overrides']}` | {r['compile_s']:.1f} ({r['first_step_s']:.1f}) "
            f"| {graphs} | {eager} | {_fmt(r.get('images_per_sec'), '.1f')} "
            f"| {_fmt(r.get('step_ms'), '.2f')} | {vs} | {_fmt(r.get('mfu'), '.1%')} "
            f"| {_fmt(r.get('mfu_vs_matmul'), '.1%')} | {_fmt(r.get('peak_mem_gb'), '.2f')} "
            f"| {r.get('verdict', '—')} |"
        )
    for name, cats in profiles.items():
        lines += ["", f"Profile of {name} ({cats['wall_ms']:.2f} ms per step under the profiler):",
                  "", "| category | ms / step |", "|---|---:|"]  # fmt: skip
        for label in ("GEMM", "attention", "element-wise", "optimizer", "copies", "idle"):
            lines.append(f"| {label} | {cats.get(label, 0.0):.3f} |")
    return "\n".join(lines) + "\n"


def write(out, header, rows, rounds, versus, profiles):
    with open(os.path.join(out, "step_ab.md"), "w") as f:
        f.write(markdown(header, rows, versus, profiles))
    data = {"header": header, "rows": rows, "rounds": rounds, "versus": versus,
            "profiles": profiles}  # fmt: skip
    with open(os.path.join(out, "step_ab.json"), "w") as f:
        json.dump(data, f, indent=1)


# ------------------------------------------------------------------------------------------------ #
# The run
# ------------------------------------------------------------------------------------------------ #


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    deadline = timing.Deadline(args.deadline_s)
    os.makedirs(args.out, exist_ok=True)
    config_ = torch._dynamo.config  # every variant's graphs live in this one process
    limit = "recompile_limit" if hasattr(config_, "recompile_limit") else "cache_size_limit"
    setattr(config_, limit, max(getattr(config_, limit), 64))
    baseline = args.variant[0][0]
    # the baseline, the libraries, then the other variants: a deadline cuts levers first
    libraries = [(k, None) for k in LIBRARIES if getattr(args, k)]
    todo = args.variant[:1] + libraries + args.variant[1:]
    header, rows, rounds, profiles, contenders, shapes = {}, [], {}, {}, {}, {}
    peak = measured = versus = first_cfg = device = None
    for name, opts in todo:
        if deadline.passed(margin=5):
            rows.append({"name": name, "overrides": opts or "", "note": "skipped: deadline"})
            write(args.out, header, rows, rounds, versus, profiles)
            continue
        if opts is None and first_cfg is None:
            rows.append({"name": name, "overrides": "", "note": "not run: no pycls variant ran"})
            continue
        try:
            if opts is None:
                c = LIBRARIES[name](args, first_cfg, device)
            else:
                c, cfg, device = build_pycls(args, name, opts)
                if not header:
                    first_cfg = cfg
                    precision = builders.build_precision(cfg, device)
                    peak = bench.peak_tflops(device, bench.compute_dtype_name(precision))
                    n = 256 if args.tiny else None  # a rehearsal's matmul: a fraction of a second
                    measured = timing.matmul_tflops(device, precision.compute_dtype, n)
                    header = run_header(args, argv, device, cfg, peak, measured)
            fields, warning = warm(c, args, device)
        except torch.OutOfMemoryError:
            rows.append({"name": name, "overrides": opts or "", "note": "out of memory"})
            continue
        except Exception as e:  # a key this checkout lacks, timm missing, float8 on a CPU...
            note = f"not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append({"name": name, "overrides": opts or "", "note": note})
            print(f"{name}: {note}", flush=True)
            write(args.out, header, rows, rounds, versus, profiles)
            continue
        if warning:
            print(f"WARNING {name}: {warning}", flush=True)
        contenders[name] = c
        rounds[name] = []
        row = {"name": name, "kind": c.kind, "overrides": c.overrides, "batch": c.batch,
               "flops_per_step": c.flops_per_step, "compiled": c.compiled, **fields}  # fmt: skip
        if c.kind == "pycls":
            shapes.setdefault("baseline", c.shape)
            row["same_model"] = c.shape == shapes["baseline"]
        rows.append(row)
        # one turn now, so that a run stopped later still has this variant's number
        rounds[name].append(timing.time_calls(c.step, device, 0, 1, group=args.iters).median)
        versus = summarize(rows, rounds, baseline, peak, measured)
        write(args.out, header, rows, rounds, versus, profiles)
        print(f"{name}: built and warmed up; {row.get('images_per_sec', 0):.1f} img/s", flush=True)
    names = list(contenders)
    for index in range(1, args.rounds):
        per_turn = max((rounds[n][-1] for n in names), default=0) * args.iters
        if deadline.passed(margin=per_turn * len(names) + 5):
            header["rounds"] = f"{index} of {args.rounds} (the deadline came first)"
            break
        shift = index % max(len(names), 1)
        order = names[shift:] + names[:shift]
        done = timing.alternate(
            {n: lambda n=n: timing.time_calls(contenders[n].step, device, 0, 1,
                                              group=args.iters).median for n in order},
            1, rotate=False, log=None,
        )  # fmt: skip
        for n in order:
            rounds[n].append(done.results[n][0])
        versus = summarize(rows, rounds, baseline, peak, measured)
        write(args.out, header, rows, rounds, versus, profiles)
    for name in args.profile:
        if name not in contenders or contenders[name].optimizer is None:
            continue
        if deadline.passed(margin=10):
            profiles[name] = {"wall_ms": 0.0, "note": "skipped: deadline"}
            continue
        profiles[name] = profile(contenders[name], args.profile_steps, device)
        write(args.out, header, rows, rounds, versus, profiles)
    write(args.out, header, rows, rounds, versus, profiles)
    print(markdown(header, rows, versus, profiles))
    return rows


def run_header(args, argv, device, cfg, peak, measured):
    cuda = device.type == "cuda"
    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "git": timing.source_revision(),
        "load average (1 min) at the start": _fmt(timing.load_average(), ".2f"),
        "command": "python benchmarks/step_ab.py " + shlex.join(argv),
        "config": f"{args.cfg} + {args.opts or '(no common overrides)'}",
        "model": f"{cfg.MODEL.ARCH or 'ViT'} depth {cfg.VIT.DEPTH} width {cfg.VIT.WIDTH} at "
        f"{cfg.TRAIN.IM_SIZE} px, batch {cfg.TRAIN.BATCH_SIZE}",
        "work": args.work,
        "timing": f"{args.warmup} warm-up steps, then {args.rounds} rounds of {args.iters} steps "
        "back to back per variant, order rotating",
        "datasheet peak (TFLOP/s)": _fmt(peak, ".1f"),
        "measured matmul (TFLOP/s)": _fmt(measured, ".4g"),
    }


if __name__ == "__main__":
    main()
