"""parallelize(model, cfg, device): wrap the model for TRAIN.PARALLEL, one function per engine.

The trainer does not know which engine was applied: it calls the wrapped model, and the checkpoint
code asks ``checkpoint.unwrap_model`` for the plain module.
"""

from torch.nn.parallel import DistributedDataParallel

from pycls.core import distributed as dist


def apply_ddp(model, cfg, device):
    """DistributedDataParallel; gradients are all-reduced in buckets during the backward pass."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


_ENGINES = {"ddp": apply_ddp}


def parallelize(model, cfg, device):
    """Applies TRAIN.PARALLEL to a model already on its device."""
    mode = cfg.TRAIN.PARALLEL
    if mode == "none":
        return model
    if mode not in _ENGINES:
        raise NotImplementedError(f"TRAIN.PARALLEL: {mode!r} is not available in this build")
    if not dist.is_initialized():
        raise RuntimeError(
            f"TRAIN.PARALLEL={mode} needs a process group: launch with torchrun or set NUM_PROCS"
        )
    return _ENGINES[mode](model, cfg, device)
