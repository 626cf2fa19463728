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
from pycls.atomic_files import atomic_path
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


def append_to_log(out_dir, text):
    """``text`` appended to OUT_DIR/stdout.log (a traceback the terminal is spared); False when
    it cannot be written."""
    try:
        with open(os.path.join(out_dir, LOG_FILE), "a", encoding="utf-8") as f:
            f.write(printable(text))
    except OSError:
        return False
    return True


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


def load_json_stats(log_file, timeline=True, problems=None):
    """The json_stats dicts of a log file, in order.

    ``timeline``: only the surviving timeline. A run that resumed from a checkpoint logged a
    ``resume`` line (``epoch`` epochs plus ``iter`` steps done); what an earlier attempt logged
    past that point was trained again, so it is dropped. False: every line as written.

    A log is read as it is, whatever a kill or a full disk left in it: a line that is not JSON
    (torn mid-write) is skipped, bytes that are not UTF-8 become U+FFFD, and a value that is not a
    dict is skipped. ``problems``, a list, is given one "line N: what" per such line.
    """
    out = []
    with open(log_file, "rb") as f:
        for number, raw in enumerate(f, 1):
            if _TAG.encode() not in raw:
                continue
            stats, why = _parse_json_stats(raw)
            if why is not None and problems is not None:
                problems.append(f"line {number}: {why}")
            if not isinstance(stats, dict):
                continue
            if timeline and stats.get("_type") == "resume":
                point = _progress_of(stats)
                if point is not None:
                    out = [s for s in out if not _after(s, point)]
            out.append(stats)
    return out


def _parse_json_stats(raw):
    """(stats or None, None or why the line is bad) of one raw log line holding the tag."""
    try:
        line, why = raw.decode("utf-8"), None
    except UnicodeDecodeError:
        line, why = raw.decode("utf-8", errors="replace"), "bytes that are not UTF-8"
    try:
        stats = simplejson.loads(line.split(_TAG, 1)[1])
    except simplejson.JSONDecodeError:
        return None, "not JSON (a line cut short?)"
    if not isinstance(stats, dict):
        return None, f"a {type(stats).__name__}, not a dict of stats"
    return stats, why


def _int(value):
    """``value`` as an int if it is a whole number (or its text), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() else None


def _progress_of(stats):
    """(epochs done, steps of the next epoch done) when ``stats`` was logged, or None (also for a
    line whose fields are not numbers)."""
    kind = stats.get("_type", "")
    if kind in ("train_epoch", "test_epoch", "test_epoch_ema") and "epoch_num" in stats:
        epoch = _int(stats["epoch_num"])
        return None if epoch is None else (epoch, 0)
    if kind == "train_iter":
        epoch = _int(str(stats.get("epoch")).split("/")[0])
        step = _int(str(stats.get("iter")).split("/")[0])
        return None if epoch is None or step is None else (epoch - 1, step)
    if kind == "resume":
        epoch, step = _int(stats.get("epoch", 0)), _int(stats.get("iter", 0))
        return None if epoch is None or step is None else (epoch, step)
    return None


def _after(stats, point):
    progress = _progress_of(stats)
    return progress is not None and progress > point


def _is_number(value):
    return isinstance(value, int | float | decimal.Decimal) and not isinstance(value, bool)


def _curve(stats, kind, key):
    """(epochs, values) of ``key`` in the ``kind`` lines whose epoch and value are numbers."""
    points = [
        (s["epoch_num"], s[key])
        for s in stats
        if s.get("_type") == kind and _is_number(s.get("epoch_num")) and _is_number(s.get(key))
    ]
    return [p[0] for p in points], [p[1] for p in points]


def plot_training_curves(log_file, out_png):
    """PNG of train/test error and loss per epoch (matplotlib imported only here); lines whose
    values are not numbers are left out. Written under a temporary name, then renamed: a failed
    write (a full disk) leaves no partial file and is an OSError naming ``out_png``."""
    import matplotlib  # slow to import, needed only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    stats = load_json_stats(log_file)
    curves = {
        (kind, key): _curve(stats, kind, key)
        for kind in ("train_epoch", "test_epoch")
        for key in ("top1_err", "loss")
    }
    if not curves["train_epoch", "top1_err"][0]:
        return None
    fig, (ax_err, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((ax_err, "top1_err", "error"), (ax_loss, "loss", "loss")):
        for kind, label in (("train_epoch", "train"), ("test_epoch", "test")):
            epochs, values = curves[kind, key]
            if epochs:
                ax.plot(epochs, values, label=label)
        ax.set(xlabel="epoch", ylabel="top-1 error (%)" if key == "top1_err" else key, title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    try:
        with atomic_path(out_png) as tmp:  # a failed write names out_png
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_png
