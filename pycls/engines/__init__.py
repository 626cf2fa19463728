"""Parallel engines: ``parallelize(model, cfg, device, precision)`` returns an engine handle.

One module per engine (``none``, ``ddp``, ``fsdp`` with FSDP2, ``fairscale``, ``pipeline``), each a
subclass of ``base.Engine``: the one interface the trainer calls without knowing which engine it
holds. ``compat`` is the one rule of which features each engine supports (checked when the
config loads); what depends on the machine and the number of processes is checked at launch
(``pycls.distributed.preflight``).
``compat`` imports nothing, so the rule is plain data below the config; importing it runs this
package's imports, which name only modules below the config (pycls.distributed, checkpoint,
models).
"""

import torch

from pycls import distributed as dist
from pycls.engines.ddp import DDPEngine
from pycls.engines.fairscale import FairScaleEngine
from pycls.engines.fsdp import FSDPEngine
from pycls.engines.pipeline import PipelineEngine
from pycls.engines.precision import Precision
from pycls.engines.single_process import SingleProcess

ENGINES = ("none", "ddp", "fsdp", "pipeline")  # the values of TRAIN.PARALLEL
_CLASSES = {"none": SingleProcess, "ddp": DDPEngine, "fsdp": FSDPEngine, "pipeline": PipelineEngine}


def engine_class(cfg):
    """The Engine subclass TRAIN.PARALLEL (and FSDP.BACKEND) selects."""
    mode = cfg.TRAIN.PARALLEL
    if mode == "fsdp" and cfg.FSDP.BACKEND == "fairscale":
        return FairScaleEngine
    if mode not in _CLASSES:
        raise NotImplementedError(f"TRAIN.PARALLEL: {mode!r} is not one of {list(ENGINES)}")
    return _CLASSES[mode]


def model_init_device(cfg):
    """Where this process builds the model before ``parallelize``: the host (CPU), except under
    the engines that materialise only each process's shard or stage (FSDP2, the pipeline),
    where the processes other than rank 0 build it on the meta device (shapes, no storage)."""
    if engine_class(cfg).builds_from_rank0 and dist.get_rank() != 0:
        return torch.device("meta")
    return torch.device("cpu")


def parallelize(model, cfg, device, precision=None):
    """Applies TRAIN.PARALLEL (and the AMP level's cast) to a model built where
    ``model_init_device`` says (on the host, or the meta device); returns the engine handle
    (``base.Engine``) that holds it, on ``device``."""
    cls = engine_class(cfg)
    precision = precision or Precision("O0", device_type=device.type)
    if not cls.builds_from_rank0:
        model = model.to(device)
    return cls(model, cfg, device, precision)
