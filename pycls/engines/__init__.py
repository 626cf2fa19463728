"""Parallel engines: ``parallelize(model, settings, device, precision)`` returns an engine handle
(``parallelism``).

One module per engine (``single_process`` for TRAIN.PARALLEL none, ``ddp``, ``fsdp`` with FSDP2,
``fairscale``, ``pipeline``, ``tensor_parallel`` over a device mesh), each a subclass of
``base.Engine``: the one interface the trainer
calls without knowing which engine it holds. Engines take ``settings.EngineSettings`` (plain
values the builders fill from the config), never the config. ``support`` is the one rule of which
features each engine supports (checked when the config loads); what depends on the machine and
the number of processes is checked at launch (``pycls.distributed.preflight``).
"""

from typing import TYPE_CHECKING

from pycls.package_faces import install_face

# The face (pycls.package_faces): each name imports its module on first use, so that the config's
# torch-free reads of support (the engine x feature rule) and settings (the records the keys are
# generated from) cost no torch
if TYPE_CHECKING:
    from pycls.engines.ddp import DDPEngine
    from pycls.engines.fairscale import FairScaleEngine
    from pycls.engines.fsdp import FSDPEngine
    from pycls.engines.parallelism import engine_class, model_init_device, parallelize
    from pycls.engines.pipeline import PipelineEngine
    from pycls.engines.precision import Precision
    from pycls.engines.settings import (
        AmpSettings,
        DDPSettings,
        EngineSettings,
        FSDPSettings,
        MeshSettings,
        PipelineSettings,
    )
    from pycls.engines.single_process import SingleProcess
    from pycls.engines.tensor_parallel import TensorParallelEngine
    from pycls.engines.tensor_pipeline import TensorParallelPipelineEngine

install_face(__name__)
