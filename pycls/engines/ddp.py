"""TRAIN.PARALLEL ddp: DistributedDataParallel; gradients all-reduced in buckets during the
backward pass, in AMP.REDUCE_DTYPE (half gradients of O2/O3 summed in fp32 by a comm hook, as
FSDP reduces them)."""

import torch
from torch import nn

from pycls import distributed as dist
from pycls.engines.base import Engine, WrapperNoSync, require_process_group
from pycls.engines.mesh_traffic import ddp_traffic
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


def fp32_hook_needed(module, settings):
    """Whether half gradients (AMP O2, O3) are summed in fp32 (``fp32_allreduce_hook``): unless
    AMP.REDUCE_DTYPE compute."""
    half = any(p.dtype != torch.float32 for p in module.parameters())
    return half and not settings.reduce_in_compute_dtype


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
        self._report_traffic(self._ddp_traffic)

    def _ddp_traffic(self):
        """What DDP sends per step (``mesh_traffic.ddp_traffic``): every gradient as reduced
        (fp32 through the comm hook), rank 0's buffers."""
        module, settings = self._module, self.settings
        fp32 = fp32_hook_needed(module, settings)
        grads = [p for p in module.parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() * (4 if fp32 else p.element_size()) for p in grads)
        buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        return ddp_traffic(grad_bytes, buffer_bytes, dist.get_world_size())

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
        if fp32_hook_needed(module, settings):
            ddp.register_comm_hook(None, fp32_allreduce_hook)
        return ddp

    def _rewrap(self):
        # DDP sized its gradient buckets and kept the embedding's gradient accumulator (with the
        # old shape) when it wrapped the model: drop it and wrap the resized module anew
        self.model = self.step_model = None
        self.model = self._wrap(self._module, self.settings, self.device)
