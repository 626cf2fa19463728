"""Re-export shim: the ViT's pipeline cut now lives beside the model, in
``pycls.models.vit.pipeline_cut``, and the stages' runner with the pipeline engine, in
``pycls.engines.pipeline``. This module re-exports their names so that ``pycls.engines.stages``
keeps working."""

from pycls.engines.pipeline import SCHEDULES, apply_pipeline, pipeline_groups
from pycls.engines.pipeline import PipelinedModel as PipelinedViT
from pycls.models.vit.pipeline_cut import BALANCES, ViTChunk, block_ranges, partition

__all__ = [
    "BALANCES",
    "SCHEDULES",
    "PipelinedViT",
    "ViTChunk",
    "apply_pipeline",
    "block_ranges",
    "partition",
    "pipeline_groups",
]
