"""Training curves where people look: the json_stats scalars also go to TensorBoard or W&B.

Nothing new is measured: every json_stats line the run logs (``pycls.core.logging``) is passed to
the writers asked for (``TENSORBOARD``, ``WANDB_PROJECT``), which keep its numbers. Tags are
``TYPE/KEY`` (``train_iter/loss``, ``test_epoch/top1_err``); ``train_iter`` lines are stepped by
the global iteration, epoch lines by the epoch number. Units are named in the keys: errors in %,
``lr``, ``images_per_s`` (training throughput of the epoch, all processes), ``mem_mib`` (peak
device memory of the main process, MiB). The packages are imported only when asked for.
"""

import os

import yaml

from pycls import distributed as dist
from pycls.core import logging as logs
from pycls.errors import ConfigError

TENSORBOARD_DIR = "tensorboard"
_TYPES = ("train_iter", "train_epoch", "test_epoch", "test_epoch_ema")
_KEYS = ("loss", "top1_err", "top5_err", "lr")


def _fraction(text):
    """(done, total) of a "3/40" field."""
    done, total = str(text).split("/")
    return int(done), int(total)


def scalars_of(stats):
    """(step, {tag: value}) of a json_stats dict, or None for lines without curves."""
    kind = stats.get("_type")
    if kind not in _TYPES:
        return None
    values = {f"{kind}/{k}": float(stats[k]) for k in _KEYS if k in stats}
    if "mem" in stats:
        values[f"{kind}/mem_mib"] = float(stats["mem"])
    if kind == "train_iter":
        epoch, _ = _fraction(stats["epoch"])
        it, iters = _fraction(stats["iter"])
        return (epoch - 1) * iters + it, values
    if kind == "train_epoch" and stats.get("time_epoch"):
        values[f"{kind}/images_per_s"] = float(stats["num_samples"]) / float(stats["time_epoch"])
    return int(stats["epoch_num"]), values


class TensorBoardWriter:
    """Event files in ``folder`` (``tensorboard --logdir OUT_DIR/tensorboard``)."""

    def __init__(self, folder):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: TENSORBOARD runs only
        except ImportError:
            raise ConfigError(
                "TENSORBOARD: True needs the tensorboard package (pip install tensorboard)"
            ) from None
        self.writer = SummaryWriter(log_dir=folder)

    def __call__(self, step, values):
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a curve is looked at while the run goes on

    def close(self):
        self.writer.close()


class WandbWriter:
    """The same scalars as a Weights & Biases run of ``project`` (its files in OUT_DIR)."""

    def __init__(self, project, out_dir, cfg_dict):
        try:
            import wandb  # optional: WANDB_PROJECT runs only
        except ImportError:
            raise ConfigError(
                "WANDB_PROJECT: needs the wandb package (pip install wandb)"
            ) from None
        self.run = wandb.init(project=project, dir=out_dir, config=cfg_dict)

    def __call__(self, step, values):
        # W&B wants one increasing step per run, and iterations and epochs are two axes: each
        # line's own axis goes in as a value (TYPE/step), which W&B can plot against
        kind = next(iter(values)).split("/")[0]
        self.run.log({**values, f"{kind}/step": step})

    def close(self):
        self.run.finish()


class ScalarSink:
    """Registered with pycls.core.logging: passes each json_stats line's scalars to writers."""

    def __init__(self, writers):
        self.writers = writers

    def __call__(self, stats):
        found = scalars_of(stats)
        if found is not None and found[1]:
            for write in self.writers:
                write(*found)

    def close(self):
        for writer in self.writers:
            writer.close()


def open_sink(cfg):
    """The writers cfg asks for, registered for this process's json_stats lines; None if none
    (or not the main process). ``close_sink`` ends them."""
    if not dist.is_main_proc() or not (cfg.TENSORBOARD or cfg.WANDB_PROJECT):
        return None
    writers = []
    if cfg.TENSORBOARD:
        writers.append(TensorBoardWriter(os.path.join(cfg.OUT_DIR, TENSORBOARD_DIR)))
    if cfg.WANDB_PROJECT:
        writers.append(WandbWriter(cfg.WANDB_PROJECT, cfg.OUT_DIR, yaml.safe_load(cfg.dump())))
    sink = ScalarSink(writers)
    logs.add_stats_sink(sink)
    return sink


def close_sink(sink):
    if sink is not None:
        logs.remove_stats_sink(sink)
        sink.close()
