"""Which engine a TRAIN.PARALLEL setting is, and applying it: ``parallelize(model, settings, device,
precision)`` returns the engine handle (``pycls.engines.base.Engine``) that holds the model."""

import torch

from pycls import distributed as dist
from pycls.engines import float8
from pycls.engines.ddp import DDPEngine
from pycls.engines.fairscale import FairScaleEngine
from pycls.engines.fsdp import FSDPEngine
from pycls.engines.pipeline import PipelineEngine
from pycls.engines.precision import Precision
from pycls.engines.settings import EngineSettings
from pycls.engines.single_process import SingleProcess
from pycls.engines.tensor_parallel import TensorParallelEngine
from pycls.engines.tensor_pipeline import TensorParallelPipelineEngine

_CLASSES = {
    "none": SingleProcess,
    "ddp": DDPEngine,
    "fsdp": FSDPEngine,
    "fairscale": FairScaleEngine,
    "pipeline": PipelineEngine,
    "tensor": TensorParallelEngine,
}


def engine_class(settings):
    """The Engine subclass ``settings.engine`` names (an EngineSettings)."""
    if settings.engine == "tensor" and settings.mesh.pp > 1:
        return TensorParallelPipelineEngine  # the mesh's pipeline stages
    if settings.engine not in _CLASSES:
        raise NotImplementedError(f"engine {settings.engine!r} is not one of {list(_CLASSES)}")
    return _CLASSES[settings.engine]


def model_init_device(settings):
    """Where this process builds the model before ``parallelize``: the host (CPU), except under
    the engines that materialise only each process's shard or stage (FSDP2, the pipeline, the
    device mesh), where the processes other than rank 0 build it on the meta device (shapes, no
    storage)."""
    if engine_class(settings).builds_from_rank0 and dist.get_rank() != 0:
        return torch.device("meta")
    return torch.device("cpu")


def parallelize(model, settings=None, device="cpu", precision=None):
    """Applies AMP.FLOAT8's conversion (``settings.float8``), the engine ``settings`` name (an
    EngineSettings; default: one process) and the AMP level's cast to a model built where
    ``model_init_device`` says (on the host, or the meta device); returns the engine handle
    (``base.Engine``) that holds it, on ``device``."""
    settings = settings or EngineSettings()
    device = torch.device(device)
    cls = engine_class(settings)
    precision = precision or Precision("O0", device_type=device.type)
    if settings.float8 != "none":  # before sharding: FSDP2 gathers the float8 weights
        # in float8 over NCCL; gloo (the CPU's collectives) cannot move float8 tensors
        gather_float8 = cls is FSDPEngine and device.type == "cuda"
        rows = float8.layer_rows(model, settings.float8_micro_batch)
        float8.convert(
            model,
            settings.float8,
            settings.float8_min_dim,
            gather_float8,
            layers=settings.float8_layers,
            rows=rows,
        )
    if not cls.builds_from_rank0:
        model = model.to(device)
    return cls(model, settings, device, precision)
