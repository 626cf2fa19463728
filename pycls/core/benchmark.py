"""--mode info (params, FLOPs, activations) and --mode time (per-iteration timings, MFU).

Timings use synthetic batches already on the device, so the model is measured apart from data
loading; the data loader is timed separately on the configured training set. FLOPs here are real
floating-point operations: 2 x multiply-adds for a forward pass, 3 x that for a training step.
"""

import statistics
import time

import torch

from pycls.core import builders, checkpoint, meters
from pycls.core import distributed as dist
from pycls.core import logging as logs
from pycls.core.trainer import build_training, maybe_compile, setup_env, train_step

logger = logs.get_logger(__name__)

# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets, SXM parts: {name: {dtype: peak}}
PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5},
    "V100": {"bfloat16": None, "float16": 125.0, "tf32": None, "float32": 15.7},
}


def print_info(cfg):
    """Logs and returns the model's complexity (a json_stats line of _type complexity)."""
    setup_logs_only(cfg)
    with torch.device("meta"):  # complexity needs the shapes only: allocate nothing
        model = builders.build_model(cfg)
    cx = model.complexity(cfg.TRAIN.IM_SIZE)
    logger.info(
        f"{cfg.MODEL.ARCH or cfg.MODEL.TYPE} at {cfg.TRAIN.IM_SIZE}px: "
        f"{cx['params'] / 1e6:.1f} M params, {cx['flops'] / 1e9:.2f} GFLOPs (multiply-adds), "
        f"{cx['acts'] / 1e6:.1f} M activations per image"
    )
    logs.log_json_stats({"_type": "complexity", "im_size": cfg.TRAIN.IM_SIZE, **cx})
    return cx


def setup_logs_only(cfg):
    logs.setup_logging(None)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, warmup, iters):
    """Median seconds per call of fn (device synchronised around each timed call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_tflops(device, dtype_name):
    """Datasheet dense peak of this GPU for a dtype ("bfloat16", "float16", "tf32", "float32")."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype_name)
    return None


def measured_matmul_tflops(device, dtype, n=8192, iters=10):
    """Achieved TFLOP/s of a large square matrix product, the practical ceiling (CUDA only)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_fn(lambda: a @ b, device, warmup=3, iters=iters)
    return 2 * n**3 / seconds / 1e12


def compute_dtype_name(cfg):
    if cfg.AMP.LEVEL != "O0":
        return cfg.AMP.DTYPE
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "float32"


def _synthetic_batch(cfg, device):
    batch = builders.per_process_batch(cfg.TRAIN.BATCH_SIZE, "TRAIN.BATCH_SIZE")
    size = cfg.TRAIN.IM_SIZE
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, cfg.MODEL.NUM_CLASSES, (batch,), device=device)
    return images, labels


def time_loader(cfg, device, iters):
    """Images/s of the configured training loader, through to normalised device batches."""
    loader = builders.build_loader(cfg, train=True)
    batches = builders.device_batches(cfg, loader, device, train=True)
    loader.sampler.set_epoch(0)
    n_images, it = 0, iter(batches)
    next(it, None)  # worker start-up is not throughput
    start = time.perf_counter()
    for _ in range(iters):
        batch = next(it, None)
        if batch is None:
            break
        n_images += batch[1].numel()
    _sync(device)
    return n_images / max(time.perf_counter() - start, 1e-9)


def time_model(cfg):
    """Times forward, forward+backward, optimizer step and full train step; logs iter_times."""
    device = setup_env(cfg)
    model, optimizer, scaler, loss_fn, precision = build_training(cfg, device)
    model = maybe_compile(cfg, model)
    images, labels = _synthetic_batch(cfg, device)
    warmup, iters = cfg.PREC_TIME.WARMUP_ITER, cfg.PREC_TIME.NUM_ITER

    @torch.no_grad()
    def forward():
        with precision.autocast():
            model(precision.cast_input(images))

    def forward_backward():
        with precision.autocast():
            logits = model(precision.cast_input(images))
        optimizer.zero_grad(set_to_none=not getattr(optimizer, "contiguous", False))
        scaler.scale(loss_fn(logits.float(), labels)).backward()

    def step():
        train_step(
            model, optimizer, scaler, loss_fn, precision, images, labels, cfg.OPTIM.CLIP_GRAD
        )

    model.eval()
    t_fw = time_fn(forward, device, warmup, iters)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_fwbw = time_fn(forward_backward, device, warmup, iters)
    t_opt = time_fn(optimizer.step, device, warmup, iters)
    t_step = time_fn(step, device, warmup, iters)
    loader_ims = time_loader(cfg, device, iters)
    return _report(cfg, device, model, images.size(0), t_fw, t_fwbw, t_opt, t_step, loader_ims)


def _report(cfg, device, model, batch, t_fw, t_fwbw, t_opt, t_step, loader_ims):
    flops = 2 * checkpoint.unwrap_model(model).complexity(cfg.TRAIN.IM_SIZE)["flops"]
    world = dist.get_world_size()
    achieved = 3 * flops * batch / t_step / 1e12
    dtype_name = compute_dtype_name(cfg)
    peak = peak_tflops(device, dtype_name)
    measured = measured_matmul_tflops(device, precision_dtype(cfg))
    stats = {
        "_type": "iter_times",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "batch_size": batch * world,
        "im_size": cfg.TRAIN.IM_SIZE,
        "amp": f"{cfg.AMP.LEVEL}/{cfg.AMP.DTYPE}",
        "test_fw_time": t_fw,
        "train_fw_bw_time": t_fwbw,
        "optim_step_time": t_opt,
        "train_step_time": t_step,
        "train_images_per_sec": batch * world / t_step,
        "test_images_per_sec": batch * world / t_fw,
        "loader_images_per_sec": loader_ims * world,
        "train_tflops": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "matmul_tflops": measured,
        "mfu_vs_matmul": achieved / measured if measured else None,
        "peak_mem_mb": meters.gpu_mem_usage_mb(),
    }
    limiter = "data loader" if loader_ims < stats["train_images_per_sec"] / world else "model"
    logger.info(
        f"train step {t_step * 1e3:.1f} ms = {stats['train_images_per_sec']:.1f} img/s, "
        f"{achieved:.2f} TFLOP/s, loader {stats['loader_images_per_sec']:.1f} img/s "
        f"(the {limiter} limits)"
    )
    logs.log_json_stats(stats)
    return stats


def precision_dtype(cfg):
    return torch.float32 if cfg.AMP.LEVEL == "O0" else getattr(torch, cfg.AMP.DTYPE)
