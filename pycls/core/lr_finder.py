"""--mode lrfind: the learning-rate range test (Smith, "Cyclical learning rates", 2017).

The learning rate grows exponentially from LRFIND.START_LR to LRFIND.END_LR over LRFIND.NUM_ITERS
training iterations of the configured model and data; the smoothed loss is recorded at each. The
run stops early once the loss diverges (DIVERGE_FACTOR x its minimum). The suggested rate is where
the smoothed loss falls fastest (steepest negative slope against log LR), before its minimum.
Writes OUT_DIR/lrfind.csv, OUT_DIR/lrfind.png and a json_stats line of _type ``lrfind``.
"""

import math
import os

import torch

from pycls import distributed as dist
from pycls.core import logging as logs
from pycls.core.trainer import Trainer, check_processes, setup_env

logger = logs.get_logger(__name__)


def lr_at(i, num_iters, start_lr, end_lr):
    """Exponential ramp: start_lr at i = 0, end_lr at i = num_iters - 1."""
    return start_lr * (end_lr / start_lr) ** (i / max(num_iters - 1, 1))


def suggest_lr(lrs, losses):
    """The rate of steepest descent of the loss against log LR, before the loss minimum."""
    if len(lrs) < 3:
        return lrs[0] if lrs else None
    best = min(range(len(losses)), key=losses.__getitem__)
    slopes = [
        (losses[i + 1] - losses[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1]))
        for i in range(1, max(best, 2))
    ]
    return lrs[1 + min(range(len(slopes)), key=slopes.__getitem__)]


def _batches(trainer):
    """Training micro-batches, epoch after epoch, for as long as the range test needs them."""
    epoch = 0
    while True:
        trainer.train_loader.sampler.set_epoch(epoch)
        yield from trainer.train_batches
        epoch += 1


def _global_mean_loss(outs, device):
    """The mean loss of the step's global batch (a collective); None if no process had an image.

    ``outs`` are this process's ``[(out, n)]`` of the step's micro-batches: ``out`` the
    (loss, logits) of ``n`` images, or None for a micro-batch of corrupt images only."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for out, n in outs:
        if out is not None:
            sums[0] += out[0].double() * n
            sums[1] += n
    dist.all_reduce_sum([sums])
    total, count = sums.tolist()  # the test needs every loss on the host: one sync per iteration
    return total / count if count else None


def find_lr(cfg):
    """Runs the range test; returns dict(lrs, losses, suggested_lr).

    Every process records the loss of the global batch and the decision to stop is taken by all
    of them together (``engine.any``), so no process leaves the loop while others wait for it."""
    check_processes(cfg, dist.get_world_size())
    device = setup_env(cfg)
    trainer = Trainer(cfg, device)
    engine = trainer.engine
    engine.train()
    f = cfg.LRFIND
    lrs, losses, smoothed, best = [], [], None, float("inf")
    batches, mixing = _batches(trainer), trainer.mixer.active(0)
    for i in range(f.NUM_ITERS):
        lr = lr_at(i, f.NUM_ITERS, f.START_LR, f.END_LR)
        # the trainer's own step: accumulation, mixup/cutmix, clipping and EMA as configured
        outs = trainer.step(batches, lr, mixing)
        value = _global_mean_loss(outs, device)
        if value is None:
            continue
        stop = not math.isfinite(value)
        if not stop:
            smoothed = (
                value if smoothed is None else f.SMOOTHING * value + (1 - f.SMOOTHING) * smoothed
            )
            lrs.append(lr)
            losses.append(smoothed)
            best = min(best, smoothed)
            stop = smoothed > f.DIVERGE_FACTOR * best
        if engine.any(stop):
            break
    suggested = suggest_lr(lrs, losses)
    if dist.is_main_proc():
        _write(cfg.OUT_DIR, lrs, losses, suggested)
    logs.log_json_stats(
        {
            "_type": "lrfind",
            "suggested_lr": suggested,
            "num_iters": len(lrs),
            "min_loss": min(losses) if losses else None,
        }
    )
    logger.info(f"suggested learning rate: {suggested}")
    return {"lrs": lrs, "losses": losses, "suggested_lr": suggested}


def _write(out_dir, lrs, losses, suggested):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "lrfind.csv"), "w") as f:
        f.write("lr,smoothed_loss\n")
        f.writelines(f"{lr:.6e},{loss:.6f}\n" for lr, loss in zip(lrs, losses))
    import matplotlib  # slow to import, needed only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lrs, losses)
    if suggested is not None:
        ax.axvline(suggested, color="tab:red", linestyle="--", label=f"suggested {suggested:.2e}")
        ax.legend()
    ax.set(xscale="log", xlabel="learning rate", ylabel="smoothed loss", title="LR range test")
    limits = plot_y_limits(losses)
    if limits is not None:
        ax.set_ylim(*limits)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "lrfind.png"), dpi=100)
    plt.close(fig)
    return limits


def plot_y_limits(losses, margin=0.1):
    """The informative loss range: from the minimum up to the highest loss before it (the start
    of the test), with a margin. The divergence after the minimum, which can be many times
    larger, runs off the top instead of flattening the descent; None if there is no range."""
    if len(losses) < 2:
        return None
    best = min(range(len(losses)), key=losses.__getitem__)
    low, high = losses[best], max(losses[: best + 1])
    if high <= low:  # rising from the start: nothing descends, show it all
        high = max(losses)
    span = high - low
    return (low - margin * span, high + margin * span) if span > 0 else None
