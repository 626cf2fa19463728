"""TRAIN.PARALLEL pipeline: the ViT cut into stages over PIPELINE.STAGES processes
(pycls.core.pipeline), data-parallel over the rest. Checkpoints are sharded folders."""

from pycls.engines.base import (
    Engine,
    ShardedFolderState,
    WrapperNoSync,
    broadcast_from_rank0,
    gather_to_rank0,
    require_process_group,
)
from pycls.engines.scaling import AgreeingLossScaler


class PipelineEngine(WrapperNoSync, ShardedFolderState, Engine):
    name = "pipeline"

    def __init__(self, model, cfg, device, precision):
        from pycls.core.pipeline import apply_pipeline

        require_process_group(self.name)
        model = broadcast_from_rank0(precision.prepare_model(model))
        super().__init__(model, cfg, device, precision)
        self.model = self.step_model = apply_pipeline(
            model, cfg, device, precision, reduce_dtype=self.reduce_dtype
        )

    def make_scaler(self):
        return AgreeingLossScaler.for_precision(self.precision, self.device)

    def _forward_backward(self, images, targets, loss_fn, scaler, loss_scale):
        # the pipeline runs forward and backward in its schedule
        return self.step_model.forward_backward(
            images, targets, loss_fn, self.precision, scaler, loss_scale
        )

    def clip_grad_norm_(self, optimizer, max_norm):
        return self.model.clip_grad_norm_(max_norm)  # over the stages of all processes

    def full_state_dict(self):
        merged = {}
        for part in gather_to_rank0(self.model.state_dict()) or []:
            merged.update(part)
        return merged
