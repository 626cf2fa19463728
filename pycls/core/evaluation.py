"""Evaluation on the test split: loss, top-1/top-5 error and the best top-1 error so far, for an
engine or a plain module, with the test sampler's padding left out of the counts."""

import contextlib
import time

import torch

from pycls.core import builders, meters
from pycls.core import logging as logs
from pycls.datasets.loading import checks


class Evaluator:
    """Evaluation on the test split: loss, top-1/top-5 error, best top-1 error so far per kind."""

    def __init__(self, cfg, device, precision, loss_fn):
        self.cfg, self.device, self.precision, self.loss_fn = cfg, device, precision, loss_fn
        self.test_loader = builders.build_loader(cfg, train=False)
        self.test_batches = builders.device_batches(cfg, self.test_loader, device, train=False)
        self.min_top1_err = {}  # json_stats _type -> best top-1 error so far

    @torch.no_grad()
    def run(self, model, epoch, stats_type="test_epoch", image_size=None):
        """Evaluates ``model`` (an engine, or a plain module); logs and returns a json_stats dict
        of ``stats_type``."""
        self.test_loader.sampler.set_epoch(epoch)
        self.test_loader.sampler.set_image_size(image_size or self.cfg.TEST.IM_SIZE)
        evaluating = model.evaluating() if hasattr(model, "evaluating") else _eval_mode(model)
        meter = meters.Meter(self.device)
        # The sampler pads the test set to a multiple of the processes (every process runs the
        # same number of batches, which FSDP and the pipeline need); the padding is not counted
        real = self.test_loader.sampler.num_unpadded()
        with evaluating as forward:
            for images, labels, num_skipped in self.test_batches:
                n = labels.numel()
                keep, real = min(n, max(real, 0)), real - n - num_skipped
                if n == 0:
                    meter.add_skipped(num_skipped)
                    continue
                with self.precision.autocast():
                    logits = forward(self.precision.cast_input(images))
                if keep == 0:
                    continue
                logits, labels = logits[:keep], labels[:keep]
                loss = self.loss_fn(logits.float(), labels)
                meter.update(loss, logits, labels, num_skipped)
        meter.sync()
        stats = meter.epoch_stats()
        checks.refuse_all_skipped(
            stats, "test samples", "there is nothing to evaluate", self.cfg.OUT_DIR
        )
        best = min(self.min_top1_err.get(stats_type, float("inf")), stats["top1_err"])
        self.min_top1_err[stats_type] = best
        stats.update(
            _type=stats_type,
            epoch=f"{epoch + 1}/{self.cfg.OPTIM.MAX_EPOCH}",
            epoch_num=epoch + 1,
            min_top1_err=best,
            time_epoch=time.perf_counter() - meter.epoch_start,
            im_size=self.test_loader.sampler.image_size,
            mem=meters.gpu_mem_usage_mb(),
        )
        logs.log_json_stats(stats)
        return stats


@contextlib.contextmanager
def _eval_mode(model):
    model.eval()
    yield model
