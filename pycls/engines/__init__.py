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

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "parallelism": ["engine_class", "model_init_device", "parallelize"],
        "single_process": ["SingleProcess"],
        "ddp": ["DDPEngine"],
        "fsdp": ["FSDPEngine"],
        "fairscale": ["FairScaleEngine"],
        "pipeline": ["PipelineEngine"],
        "tensor_parallel": ["TensorParallelEngine"],
        "tensor_pipeline": ["TensorParallelPipelineEngine"],
        "precision": ["Precision"],
        "settings": [
            "DDPSettings",
            "EngineSettings",
            "FSDPSettings",
            "MeshSettings",
            "PipelineSettings",
        ],
    },
)
