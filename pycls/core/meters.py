"""Meters that accumulate on the device and synchronise only when asked.

A training iteration adds its loss and top-k hits into one small device tensor: no ``.item()``,
no host-device sync. ``sync()`` is called every LOG_PERIOD iterations and at epoch end: one copy
to the host (and one all-reduce across processes) for everything. A ViT's training batches also
count the token positions its blocks computed (host numbers), logged as ``tokens_per_sec`` and
``tokens_per_image``. Batches drawn through ``timed`` count the host's time waiting for the next
one, logged as ``data_wait_share``: the share of the window's wall time this process spent in
the loader (no device sync: what the host waited for, not what the device did meanwhile).
"""

import time

import torch

from pycls import distributed as dist
from pycls.datasets.loading import checks

# Order of the device-side sums; the sample and skipped counts are known on the host
_LOSS, _TOP1, _TOP5 = range(3)


def topk_correct(logits, labels, ks=(1, 5)):
    """Number of samples whose label is in the top-k predictions, for each k (device tensor)."""
    maxk = min(max(ks), logits.size(1))
    top = logits.topk(maxk, dim=1).indices
    hits = top.eq(labels.view(-1, 1))
    return torch.stack([hits[:, : min(k, maxk)].any(dim=1).sum() for k in ks])


def topk_errors(logits, labels, ks=(1, 5)):
    """Top-k error in percent, for each k (a list of device tensors)."""
    correct = topk_correct(logits, labels, ks).float()
    return [(1.0 - c / labels.size(0)) * 100.0 for c in correct]


class Meter:
    """Loss and top-1/top-5 error over an epoch and over the current logging window."""

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self):
        # host: loss, top1, top5, n, skipped, tokens, tokens inside the timed windows
        self._epoch = torch.zeros(7, dtype=torch.float64)
        self._epoch_tokens_time = 0.0  # the seconds of the windows that counted tokens
        self._window = torch.zeros(3, dtype=torch.float64, device=self.device)
        # samples, skipped images, tokens, tokens since the clock last started: host integers
        self._window_counts = [0, 0, 0, 0]
        self._last_sync = time.perf_counter()
        self._steps_since_sync = 0
        self.iter_time = 0.0
        self.epoch_start = time.perf_counter()
        # Seconds waiting for batches (``timed``): this window's; the epoch's and its windows'
        self._timing, self._wait, self._epoch_wait, self._epoch_seconds = False, 0.0, 0.0, 0.0

    def timed(self, batches):
        """``batches`` (an iterable), the host's time waiting for each next one counted."""
        self._timing, batches = True, iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._wait += time.perf_counter() - start
            yield batch

    def update(self, loss, logits, labels, num_skipped=0, tokens=0):
        """Adds one batch: loss is the batch-mean loss (a 0-d device tensor); ``tokens`` the token
        positions the model computed for it (0: not counted). No host sync: the sums stay on the
        device and the counts on the host."""
        n = labels.size(0)
        hits = topk_correct(logits, labels).to(torch.float64)
        self._window += torch.cat([(loss.detach().to(torch.float64) * n).view(1), hits])
        self._window_counts[0] += n
        self._window_counts[1] += num_skipped
        self._window_counts[2] += tokens
        self._window_counts[3] += tokens
        checks.record_skipped(num_skipped)  # names them in the log and skipped_files.txt

    def add_skipped(self, num_skipped):
        """Counts corrupt images of a batch that had nothing else left to train on."""
        self._window_counts[1] += num_skipped
        checks.record_skipped(num_skipped)

    def end_step(self):
        """Counts one optimizer step (of however many accumulated micro-batches): ``iter_time``
        is the time per step, the unit of the trainer's ETA."""
        self._steps_since_sync += 1

    def restart_clock(self):
        """Leaves the steps so far out of ``iter_time`` (a first step that compiled the model);
        returns the seconds they took."""
        now = time.perf_counter()
        elapsed, self._last_sync, self._steps_since_sync = now - self._last_sync, now, 0
        self._window_counts[3] = 0  # their tokens are not in the next window's time either
        self._wait = 0.0  # nor their wait
        return elapsed

    def sync(self):
        """Moves the window into the epoch totals; returns window stats (all processes reduced)."""
        window = torch.cat([self._window, self._window.new_tensor(self._window_counts)])
        dist.all_reduce_sum([window])
        window = window.tolist()  # the one host-device sync per logging window
        now = time.perf_counter()
        seconds = now - self._last_sync
        if self._steps_since_sync:
            self.iter_time = seconds / self._steps_since_sync
        self._last_sync, self._steps_since_sync = now, 0
        self._epoch += torch.tensor(window, dtype=torch.float64)
        if window[-1]:
            self._epoch_tokens_time += seconds
        self._window.zero_()
        self._window_counts = [0, 0, 0, 0]
        stats = _stats(window, seconds)
        if self._timing:
            stats["data_wait_share"] = min(1.0, self._wait / seconds) if seconds > 0 else 0.0
            self._epoch_wait += self._wait
            self._epoch_seconds += seconds
            self._wait = 0.0
        return stats

    def epoch_stats(self):
        """Totals of the epoch (call sync() first so the last window is included)."""
        stats = _stats(self._epoch.tolist(), self._epoch_tokens_time)
        if self._timing:
            share = self._epoch_wait / self._epoch_seconds if self._epoch_seconds > 0 else 0.0
            stats["data_wait_share"] = min(1.0, share)
        return stats


def _stats(sums, seconds=0.0):
    loss, top1, top5, n, skipped, tokens, timed_tokens = sums
    count = max(n, 1.0)
    stats = {
        "loss": loss / count,
        "top1_err": 100.0 * (1.0 - top1 / count),
        "top5_err": 100.0 * (1.0 - top5 / count),
        "num_samples": int(n),
        "num_skipped": int(skipped),
    }
    if tokens:  # the token positions the blocks computed (padding included), all processes
        stats["tokens_per_image"] = tokens / count
        stats["tokens_per_sec"] = timed_tokens / seconds if seconds > 0 else None
    return stats


def gpu_mem_usage_mb():
    """Peak device memory of this process in MiB (0 on CPU)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.max_memory_allocated() / 1024**2)


def eta_str(seconds):
    seconds = max(int(seconds), 0)
    days, rem = divmod(seconds, 86400)
    hours, rem = divmod(rem, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{days},{hours:02d}:{minutes:02d}:{secs:02d}"
