"""TRAIN.PARALLEL ddp: DistributedDataParallel; gradients all-reduced in buckets during the
backward pass, in AMP.REDUCE_DTYPE (half gradients of O2/O3 summed in fp32 by a comm hook, as
FSDP reduces them)."""

import torch
from torch import nn

from pycls.engines.base import Engine, WrapperNoSync, require_process_group
from pycls.errors import ConfigError


def fp32_allreduce_hook(group, bucket):
    """DDP comm hook: the mean of a half-precision bucket, summed in fp32 and rounded once."""
    buffer = bucket.buffer()
    world = torch.distributed.get_world_size(group)
    full = buffer.to(torch.float32).div_(world)
    future = torch.distributed.all_reduce(full, group=group, async_op=True).get_future()

    def back(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(back)


def sync_batch_norm(model, device):
    """BN.SYNC: every batch norm of ``model`` as a SyncBatchNorm (same weights and statistics),
    normalising with the whole global batch's statistics."""
    if device.type != "cuda":
        raise ConfigError(
            f"BN.SYNC: SyncBatchNorm needs CUDA (PyTorch has no CPU kernel for it); the device "
            f"is {device.type}"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


class DDPEngine(WrapperNoSync, Engine):
    name = "ddp"
    empty_batches_need_a_pass = True

    def __init__(self, model, settings, device, precision):
        require_process_group(self.name)
        if settings.sync_batch_norm:
            model = sync_batch_norm(model, device)
        self._module = precision.prepare_model(model)
        wrapped = self._wrap(self._module, settings, device)
        super().__init__(wrapped, settings, device, precision)

    @property
    def module(self):
        return self._module

    def _wrap(self, module, settings, device):
        """DDP with the bucket settings (it broadcasts rank 0's weights)."""
        d = settings.ddp
        ddp = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=d.bucket_cap_mb,
            gradient_as_bucket_view=d.gradient_as_bucket_view,
            static_graph=d.static_graph,
            find_unused_parameters=d.find_unused_parameters,
        )
        half = any(p.dtype != torch.float32 for p in module.parameters())
        if half and not settings.reduce_in_compute_dtype:
            ddp.register_comm_hook(None, fp32_allreduce_hook)
        return ddp

    def _rewrap(self):
        # DDP sized its gradient buckets and kept the embedding's gradient accumulator (with the
        # old shape) when it wrapped the model: drop it and wrap the resized module anew
        self.model = self.step_model = None
        self.model = self._wrap(self._module, self.settings, self.device)
