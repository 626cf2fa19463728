"""TRAIN.PARALLEL pipeline: the ViT cut into stages over PIPELINE.STAGES processes
(pycls.engines.stages), data-parallel over the rest. Checkpoints are sharded folders.

No process holds the whole model on the device: only rank 0 builds its weights, on the host; the
others build it on the meta device. Every process cuts the meta model, allocates its own stages
and receives their weights from rank 0 (``PipelinedViT.materialise``).
"""

from pycls.engines.base import (
    Engine,
    ShardedFolderState,
    WrapperNoSync,
    gather_to_rank0,
    host_weights,
    require_process_group,
)
from pycls.engines.loss_scaling import AgreeingLossScaler
from pycls.engines.stages import apply_pipeline


class PipelineEngine(WrapperNoSync, ShardedFolderState, Engine):
    name = "pipeline"
    builds_from_rank0 = True

    def __init__(self, model, settings, device, precision):
        require_process_group(self.name)
        weights = host_weights(model)  # rank 0's initial (or TRAIN.WEIGHTS) weights, fp32
        # rank 0's model too is cut on the meta device, cast for the AMP level (shapes and dtypes)
        model = precision.prepare_model(model.to_empty(device="meta"))
        super().__init__(model, settings, device, precision)
        self.model = self.step_model = apply_pipeline(
            model, settings.pipeline, device, precision, reduce_dtype=self.reduce_dtype
        )
        self.model.materialise(weights)

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
