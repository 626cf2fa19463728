"""Parallel engines: ``parallelize(model, cfg, device, precision)`` returns an engine handle.

One module per engine (``none``, ``ddp``, ``fsdp`` with FSDP2, ``fairscale``, ``pipeline``), each a
subclass of ``base.Engine``: the one interface the trainer calls without knowing which engine it
holds. ``compat`` is the one rule of which features each engine supports (checked when the
config loads); ``check.check_cfg`` what depends on the machine and the number of processes.
Nothing here is imported until used, so the config code can read ``compat`` without importing
the engines.
"""

ENGINES = ("none", "ddp", "fsdp", "pipeline")  # the values of TRAIN.PARALLEL


def engine_class(cfg):
    """The Engine subclass TRAIN.PARALLEL (and FSDP.BACKEND) selects."""
    mode = cfg.TRAIN.PARALLEL
    if mode == "none":
        from pycls.engines.none import SingleProcess as cls
    elif mode == "ddp":
        from pycls.engines.ddp import DDPEngine as cls
    elif mode == "fsdp" and cfg.FSDP.BACKEND == "fairscale":
        from pycls.engines.fairscale import FairScaleEngine as cls
    elif mode == "fsdp":
        from pycls.engines.fsdp import FSDPEngine as cls
    elif mode == "pipeline":
        from pycls.engines.pipeline import PipelineEngine as cls
    else:
        raise NotImplementedError(f"TRAIN.PARALLEL: {mode!r} is not one of {list(ENGINES)}")
    return cls


def model_init_device(cfg):
    """Where this process builds the model before ``parallelize``: the host (CPU), except under
    the engines that materialise only each process's shard or stage (FSDP2, the pipeline),
    where the processes other than rank 0 build it on the meta device (shapes, no storage)."""
    import torch

    from pycls.core import distributed as dist

    if engine_class(cfg).builds_from_rank0 and dist.get_rank() != 0:
        return torch.device("meta")
    return torch.device("cpu")


def parallelize(model, cfg, device, precision=None):
    """Applies TRAIN.PARALLEL (and the AMP level's cast) to a model built where
    ``model_init_device`` says (on the host, or the meta device); returns the engine handle
    (``base.Engine``) that holds it, on ``device``."""
    from pycls.core.precision import Precision

    cls = engine_class(cfg)
    precision = precision or Precision("O0", device_type=device.type)
    if not cls.builds_from_rank0:
        model = model.to(device)
    return cls(model, cfg, device, precision)


def needs_cpu_collectives(cfg):
    """FSDP2 with CPU offload reduces and clips host-side tensors: gloo beside NCCL."""
    return cfg.TRAIN.PARALLEL == "fsdp" and cfg.FSDP.BACKEND == "torch" and cfg.FSDP.CPU_OFFLOAD
