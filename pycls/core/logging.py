"""Logging: plain messages, json_stats lines that double as the experiment database, plots.

Every event worth keeping is one line ``json_stats: {...}`` with a ``_type`` (train_iter,
train_epoch, test_epoch, iter_times, complexity, ...). The same lines go to stdout and to
OUT_DIR/stdout.log; sweep tools parse them back with ``load_json_stats``.
"""

import builtins
import decimal
import logging
import os
import sys

import simplejson

from pycls import distributed as dist
from pycls.errors import describe_write_error, printable

_FORMAT = "[%(filename)s: %(lineno)3d]: %(message)s"
LOG_FILE = "stdout.log"
_TAG = "json_stats: "


class _LogFileHandler(logging.FileHandler):
    """A log file that reports a failed write (disk full, ...) once, in one line, instead of a
    ``--- Logging error ---`` traceback per message; messages still reach stdout."""

    failed = False

    def handleError(self, record):
        if self.failed:
            return
        self.failed = True
        err = sys.exc_info()[1]
        sys.stderr.write(
            f"error: {describe_write_error(self.baseFilename, err)}; log lines "
            "from here on go to stdout only\n"
        )


class _Formatter(logging.Formatter):
    """Lines any UTF-8 stream or file can take: a path holding bytes that are not UTF-8
    (os.fsdecode's surrogates) is written with those bytes as ``\\xNN``, never an encoding error."""

    def format(self, record):
        return printable(super().format(record))


def setup_logging(out_dir=None):
    """Main process: log to stdout and OUT_DIR/stdout.log. Others: errors only."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    handlers = [logging.StreamHandler(stream=sys.stdout)]
    if dist.is_main_proc() and out_dir:
        os.makedirs(out_dir, exist_ok=True)
        handlers.append(
            _LogFileHandler(os.path.join(out_dir, LOG_FILE), mode="a", encoding="utf-8")
        )
    level = logging.INFO if dist.is_main_proc() else logging.ERROR
    fmt = _Formatter(
        _FORMAT if dist.get_world_size() == 1 else f"[rank{dist.get_rank()}] {_FORMAT}"
    )
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(level)
    # torch and friends print through print(); keep non-main ranks quiet without losing errors
    if not dist.is_main_proc():
        builtins.print = lambda *args, **kwargs: None


def get_logger(name):
    return logging.getLogger(name)


def float_to_decimal(value, prec=6):
    """Rounds floats to ``prec`` significant digits so logs stay short and exact in JSON."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        return decimal.Decimal(f"{value:.{prec}g}")
    return value


def dump_json_stats(stats):
    """The json_stats line for a dict of stats."""
    stats = {k: float_to_decimal(v) for k, v in stats.items()}
    return _TAG + simplejson.dumps(stats, sort_keys=False, use_decimal=True)


# Callables given every json_stats dict this process logs (pycls.core.curve_writers:
# TensorBoard, W&B)
_STATS_SINKS = []


def add_stats_sink(sink):
    _STATS_SINKS.append(sink)


def remove_stats_sink(sink):
    _STATS_SINKS.remove(sink)


def log_json_stats(stats):
    logging.getLogger(__name__).info(dump_json_stats(stats))
    for sink in _STATS_SINKS:
        sink(stats)


def load_json_stats(log_file, timeline=True):
    """The json_stats dicts of a log file, in order (lines that fail to parse are skipped).

    ``timeline``: only the surviving timeline. A run that resumed from a checkpoint logged a
    ``resume`` line (``epoch`` epochs plus ``iter`` steps done); what an earlier attempt logged
    past that point was trained again, so it is dropped. False: every line as written.
    """
    out = []
    with open(log_file) as f:
        for line in f:
            if _TAG not in line:
                continue
            try:
                stats = simplejson.loads(line.split(_TAG, 1)[1])
            except simplejson.JSONDecodeError:
                continue
            if timeline and isinstance(stats, dict) and stats.get("_type") == "resume":
                point = (int(stats.get("epoch", 0)), int(stats.get("iter", 0)))
                out = [s for s in out if not _after(s, point)]
            out.append(stats)
    return out


def _progress_of(stats):
    """(epochs done, steps of the next epoch done) when ``stats`` was logged, or None."""
    if not isinstance(stats, dict):
        return None
    kind = stats.get("_type", "")
    if kind in ("train_epoch", "test_epoch", "test_epoch_ema") and "epoch_num" in stats:
        return (int(stats["epoch_num"]), 0)
    if kind == "train_iter":
        try:
            epoch = int(str(stats["epoch"]).split("/")[0])
            step = int(str(stats["iter"]).split("/")[0])
        except (KeyError, ValueError):
            return None
        return (epoch - 1, step)
    if kind == "resume":
        return (int(stats.get("epoch", 0)), int(stats.get("iter", 0)))
    return None


def _after(stats, point):
    progress = _progress_of(stats)
    return progress is not None and progress > point


def plot_training_curves(log_file, out_png):
    """PNG of train/test error and loss per epoch (matplotlib imported only here)."""
    import matplotlib  # slow to import, needed only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    stats = load_json_stats(log_file)
    train = [s for s in stats if s.get("_type") == "train_epoch"]
    test = [s for s in stats if s.get("_type") == "test_epoch"]
    if not train:
        return None
    fig, (ax_err, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    ax_err.plot([s["epoch_num"] for s in train], [s["top1_err"] for s in train], label="train")
    if test:
        ax_err.plot([s["epoch_num"] for s in test], [s["top1_err"] for s in test], label="test")
    ax_err.set(xlabel="epoch", ylabel="top-1 error (%)", title="error")
    ax_loss.plot([s["epoch_num"] for s in train], [s["loss"] for s in train], label="train")
    if test and "loss" in test[0]:
        ax_loss.plot([s["epoch_num"] for s in test], [s["loss"] for s in test], label="test")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    for ax in (ax_err, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
