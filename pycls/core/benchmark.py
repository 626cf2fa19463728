"""--mode info (params, FLOPs, activations) and --mode time (per-iteration timings, MFU).

Timings use synthetic batches already on the device, so the model is measured apart from data
loading; the data loader is timed separately on the configured training set. FLOPs here are real
floating-point operations: 2 x multiply-adds for a forward pass, 3 x that for a training step.
"""

import itertools

import torch

from pycls import distributed as dist
from pycls.core import builders, compile_stats, meters, timing, token_costs
from pycls.core import logging as logs
from pycls.core.trainer import build_training, setup_env

logger = logs.get_logger(__name__)

# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets: {name: {dtype: peak}}. The first
# key contained in torch.cuda.get_device_name() wins, so the PCIe / NVL parts come before the SXM
# ones ("NVIDIA H100 80GB HBM3" is the SXM part).
PEAK_TFLOPS = {
    "H100 PCIe": {"bfloat16": 756.5, "float16": 756.5, "tf32": 378.0, "float32": 51.2},
    "H100 NVL": {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0},
    "H200": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5},
    "V100": {"bfloat16": None, "float16": 125.0, "tf32": None, "float32": 15.7},
}


def print_info(cfg):
    """Logs and returns the model's complexity (a json_stats line of _type complexity)."""
    logs.setup_logging(None)
    with torch.device("meta"):  # complexity needs the shapes only: allocate nothing
        model = builders.build_model(cfg)
    cx = model.complexity(cfg.TRAIN.IM_SIZE)
    logger.info(
        f"{cfg.MODEL.ARCH or cfg.MODEL.TYPE} at {cfg.TRAIN.IM_SIZE}px: "
        f"{cx['params'] / 1e6:.1f} M params, {cx['flops'] / 1e9:.2f} GFLOPs (multiply-adds), "
        f"{cx['acts'] / 1e6:.1f} M activations per image"
    )
    cx.update(token_costs.effective_complexity(cfg, model))  # patch dropout, token budget
    if "flops_effective" in cx:
        logger.info(
            f"training on fewer tokens: {cx['flops_effective'] / 1e9:.2f} GFLOPs (multiply-adds) "
            f"per image at {cx['tokens_per_image']:.1f} tokens per image"
        )
    logs.log_json_stats({"_type": "complexity", "im_size": cfg.TRAIN.IM_SIZE, **cx})
    return cx


def peak_tflops(device, dtype_name):
    """Datasheet dense peak of this GPU for a dtype ("bfloat16", "float16", "tf32", "float32")."""
    if device.type != "cuda":
        return None
    return peak_tflops_for(torch.cuda.get_device_name(device), dtype_name)


def peak_tflops_for(device_name, dtype_name):
    """PEAK_TFLOPS entry of the first key contained in a CUDA device name, or None."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            return peaks.get(dtype_name)
    return None


def compute_dtype_name(precision):
    """The PEAK_TFLOPS column of a run's matmuls: its Precision's compute dtype (tf32 where fp32
    matmuls may use it)."""
    if precision.enabled:
        return str(precision.compute_dtype).removeprefix("torch.")
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "float32"


def synthetic_micro_batch(cfg, device):
    """A training micro-batch of random images and labels, already on the device: this process's
    share of TRAIN.BATCH_SIZE over TRAIN.ACCUM_STEPS, at TRAIN.IM_SIZE; under a token budget, the
    token batch of its sampler's first planned micro-batch."""
    if cfg.TRAIN.TOKEN_BUDGET > 0:
        return token_costs.synthetic_token_batch(cfg, device)
    batch = builders.per_process_batch(cfg.TRAIN.BATCH_SIZE, "TRAIN.BATCH_SIZE")
    batch //= cfg.TRAIN.ACCUM_STEPS
    size = cfg.TRAIN.IM_SIZE
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, cfg.MODEL.NUM_CLASSES, (batch,), device=device)
    return images, labels


def synthetic_training(cfg, device):
    """(the training step, a function running it once on synthetic batches, the parts it was
    built from): the trainer's own step (``pycls.core.training_step``), with the learning rate
    of the schedule's first step, mixup / cutmix as epoch 0 has them, and a device-side meter, as
    every training iteration of the config runs it (the meters' sync every LOG_PERIOD steps is
    the loop's, not the step's)."""
    engine, optimizer, scaler, loss_fn, precision = build_training(cfg, device)
    step = builders.build_training_step(cfg, engine, optimizer, scaler, loss_fn)
    batch = synthetic_micro_batch(cfg, device)
    micro_batches = itertools.repeat((*batch, 0))
    lr = builders.build_lr_schedule(cfg)(0)
    mixing = step.mixer.active(0)
    meter = meters.Meter(device)

    def run():
        return step(micro_batches, lr, mixing, meter)

    return step, run, (engine, optimizer, scaler, loss_fn, precision, batch)


def time_loader(cfg, device, iters):
    """Images/s of the configured training loader, through to normalised device batches."""
    loader = builders.build_loader(cfg, train=True)
    batches = builders.device_batches(cfg, loader, device, train=True)
    loader.sampler.set_epoch(0)
    it = iter(batches)
    next(it, None)  # worker start-up is not throughput
    counted = []

    def pull():  # up to iters batches, fewer if the epoch ends first
        for _ in range(iters):
            batch = next(it, None)
            if batch is None:
                break
            counted.append(batch[1].numel())

    seconds = timing.time_calls(pull, device).min
    return sum(counted) / max(seconds, 1e-9)


def time_model(cfg):
    """Times forward, forward+backward, full train step and optimizer step; logs iter_times.

    Units: ``*_time`` are seconds per iteration, the median of PREC_TIME.NUM_ITER timed
    iterations each synchronised with the device at its start and end, ``*_time_iqr`` their
    interquartile range (seconds); ``gflops_per_image`` and the ``*_tflops`` count FLOPs (2 per
    multiply-add), while the ``complexity`` line's ``flops`` count multiply-adds; ``peak_mem_mb``
    is MiB.

    The train step is also timed as training runs it: NUM_ITER steps back to back, the device
    synchronised once before the first and once after the last (``*_back_to_back`` fields: the
    host queues the next step while the device runs this one); ``train_step_time`` and the
    fields from it (``train_images_per_sec``, ``train_tflops``, ``mfu``) keep the per-step
    synchronised figure that earlier results compare with.

    The evaluation forward pass runs eager unless PREC_TIME.COMPILE_TEST (``test_compiled``):
    only the training graphs are compiled, as in training. ``compile_s``, ``unique_graphs``,
    ``frames_failed``, ``graph_breaks`` and ``eager_blocks`` (of ``num_blocks``) say what
    torch.compile did (``pycls.core.compile_stats``); a compiled run with a block left eager
    logs a WARNING.

    The optimizer step alone is timed last, on the unscaled gradients the last train step left,
    so that stepping on loss-scaled gradients cannot disturb the other measurements.
    """
    device = setup_env(cfg)
    before = compile_stats.snapshot()
    step, train_step, parts = synthetic_training(cfg, device)
    engine, optimizer, scaler, loss_fn, precision, (images, labels) = parts
    blocks = repeated_blocks(engine.module)
    model = engine.compile()
    probe = compile_stats.EagerBlockProbe(blocks)  # blocks compiled in place: which ran eager
    warmup, iters = cfg.PREC_TIME.WARMUP_ITER, cfg.PREC_TIME.NUM_ITER
    test_compiled = cfg.TRAIN.COMPILE and cfg.PREC_TIME.COMPILE_TEST

    @torch.no_grad()
    def forward():
        with precision.autocast():
            model(precision.cast_input(images))

    def eager_forward():  # compiled code runs eager, and nothing new is compiled
        with torch.compiler.set_stance("force_eager"):
            forward()

    # the student's pass alone: a distilled ViT's pair of heads, without the teacher's logits
    student_loss = loss_fn if step.teacher is None else step.loss_fn.bind(None)

    def forward_backward():  # the engine's own, so a pipeline runs its schedule here too
        optimizer.zero_grad(set_to_none=True)
        engine.forward_backward(images, labels, student_loss, scaler)

    def timed(key, what, fn):  # one line before and after each phase: slow runs show progress
        logger.info(f"timing {what}: {warmup} warm-up + {iters} timed iterations ...")
        q1, times[key], q3 = timing.time_calls(fn, device, warmup, iters).quartiles
        times[f"{key}_iqr"] = q3 - q1  # the spread: on a busy machine phases overlap in range
        logger.info(
            f"{what}: {times[key] * 1e3:.1f} ms per iteration (median; middle half "
            f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f} ms)"
        )

    times = {}
    model.eval()
    eager_test = cfg.TRAIN.COMPILE and not test_compiled
    timed("test_fw_time", "forward (eager)" if eager_test else "forward",
          eager_forward if eager_test else forward)  # fmt: skip
    model.train()
    probe.reset()  # the training graphs only
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed("train_fw_bw_time", "forward + backward", forward_backward)
    timed("train_step_time", "train step", train_step)  # the trainer's own step
    logger.info(f"timing the train step: {iters} steps back to back ...")
    window = timing.time_calls(train_step, device, 0, 1, group=iters)
    times["train_step_time_back_to_back"] = window.median
    logger.info(
        f"train step: {window.median * 1e3:.1f} ms per step back to back ({iters} steps, "
        "synchronised at the two ends)"
    )
    timed("optim_step_time", "optimizer step", optimizer.step)
    peak_mem = meters.gpu_mem_usage_mb() if device.type == "cuda" else None
    compiled, warning = compile_stats.report(
        compile_stats.delta(before, compile_stats.snapshot()), probe, len(blocks), cfg.TRAIN.COMPILE
    )
    probe.remove()
    if warning:
        logger.warning(warning)
    try:
        logger.info(f"timing the data loader: {iters} batches ...")
        loader_ims = time_loader(cfg, device, iters)
    except (FileNotFoundError, ValueError) as e:
        # The model was timed on synthetic data; a data set that is not here only costs the
        # loader's number, not the run
        logger.warning(f"data loader not timed: {e}")
        loader_ims = None
    batches = labels.size(0) * cfg.TRAIN.ACCUM_STEPS, labels.size(0)  # of a step, of a forward
    flops = [  # per image, of the timed forward (evaluation) and of a training forward
        token_costs.flops_per_image(engine.module, images, cfg.TRAIN.IM_SIZE, training=training)
        for training in (False, True)
    ]
    times.update(compiled, test_compiled=test_compiled)
    measured = (batches, times, loader_ims, peak_mem)
    return _report(cfg, device, engine.module, precision, measured, scaler, flops)


def repeated_blocks(module):
    """The model's repeated blocks (what TRAIN.COMPILE compiles one by one), or none."""
    return list(module.repeated_blocks()) if hasattr(module, "repeated_blocks") else []


def _report(cfg, device, model, precision, measured, scaler, flops=None):
    """The iter_times stats: throughput, achieved TFLOP/s, MFU, peak memory.

    Each phase's time is the median of its timed iterations, with ``_min`` and ``_max`` beside
    it. MFU is against the datasheet peak on a known GPU and against the measured matmul peak of
    the compute dtype elsewhere (a CPU); ``mfu_basis`` says which. ``flops``: the multiply-adds
    per image of an evaluation and of a training forward pass (they differ with patch dropout;
    default: the model's complexity at TRAIN.IM_SIZE for both). ``precision``: the run's AMP
    level (``pycls.engines.precision.Precision``), the one source of its compute dtype.
    """
    (batch, fw_batch), times, loader_ims, peak_mem = measured  # images of a step, of a forward
    if flops is None:
        flops = [model.complexity(cfg.TRAIN.IM_SIZE)["flops"]] * 2
    flops, train_flops = (2 * f for f in flops)
    world = dist.get_world_size()
    t_fw, t_step = times["test_fw_time"], times["train_step_time"]
    achieved = 3 * train_flops * batch / t_step / 1e12
    peak = peak_tflops(device, compute_dtype_name(precision))
    measured = timing.matmul_tflops(device, precision.compute_dtype)
    t_window = times.get("train_step_time_back_to_back")
    window = 3 * train_flops * batch / t_window / 1e12 if t_window else None
    stats = {
        "_type": "iter_times",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "arch": cfg.MODEL.ARCH or cfg.MODEL.TYPE,
        "batch_size": batch * world,
        "im_size": cfg.TRAIN.IM_SIZE,
        "amp": f"{precision.level}/{compute_dtype_name(precision)}" if precision.enabled else "O0",
        "compile": cfg.TRAIN.COMPILE,
        **times,
        "train_images_per_sec": batch * world / t_step,
        "test_images_per_sec": fw_batch * world / t_fw,
        "loader_images_per_sec": loader_ims * world if loader_ims is not None else None,
        "gflops_per_image": train_flops / 1e9,  # of the training step's forward pass
        "test_gflops_per_image": flops / 1e9,
        "test_tflops": flops * fw_batch / t_fw / 1e12,
        "train_tflops": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else (achieved / measured if measured else None),
        "mfu_basis": "datasheet" if peak else ("measured matmul" if measured else None),
        "matmul_tflops": measured,
        "mfu_vs_matmul": achieved / measured if measured else None,
        "peak_mem_mb": peak_mem,
        "skipped_steps": scaler.skipped_steps,
    }
    if t_window:  # the steps as training runs them: back to back, synchronised at the ends
        stats.update(
            train_images_per_sec_back_to_back=batch * world / t_window,
            train_tflops_back_to_back=window,
            mfu_back_to_back=window / peak if peak else (window / measured if measured else None),
            mfu_vs_matmul_back_to_back=window / measured if measured else None,
        )
    mfu = ""
    if stats["mfu"] is not None:
        basis = "" if peak else f" of the measured {measured:.2f} TFLOP/s matmul"
        mfu = f", MFU {stats['mfu']:.1%}{basis}"
    loader = "loader not timed"
    if loader_ims is not None:
        limiter = "data loader" if loader_ims < stats["train_images_per_sec"] / world else "model"
        loader = f"loader {stats['loader_images_per_sec']:.1f} img/s (the {limiter} limits)"
    logger.info(
        f"train step {t_step * 1e3:.1f} ms = {stats['train_images_per_sec']:.1f} img/s, "
        f"{achieved:.2f} TFLOP/s{mfu}, {loader}"
    )
    if t_window:
        m = stats["mfu_back_to_back"]
        logger.info(
            f"train step back to back {t_window * 1e3:.1f} ms = "
            f"{stats['train_images_per_sec_back_to_back']:.1f} img/s, {window:.2f} TFLOP/s"
            + ("" if m is None else f", MFU {m:.1%}")
        )
    if "unique_graphs" in stats:
        logger.info(
            f"compiled: {stats['unique_graphs']} graph(s) in {stats['compile_s']:.1f} s, "
            f"{stats['frames_failed']} frame(s) fell back to eager, {stats['graph_breaks']} "
            f"graph break(s), eager blocks: {stats['eager_blocks']} of {stats['num_blocks']}"
        )
    logs.log_json_stats(stats)
    return stats
