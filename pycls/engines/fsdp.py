"""TRAIN.PARALLEL fsdp (FSDP.BACKEND torch): FSDP2, ``fully_shard`` per block and on the root.

Parameters keep their names and become DTensor shards, which the foreach optimizer updates
directly. Under AMP the model is not cast: the fp32 shards are the master weights and the policy
casts gathered parameters to half for compute, reducing gradients in AMP.REDUCE_DTYPE.
"""

import contextlib

import torch

from pycls.core import distributed as dist
from pycls.engines.base import (
    Engine,
    ShardedFolderState,
    broadcast_from_rank0,
    require_process_group,
)
from pycls.engines.scaling import AgreeingLossScaler


class FSDPEngine(ShardedFolderState, Engine):
    name = "fsdp"
    holds_master_weights = True
    empty_batches_need_a_pass = True

    def __init__(self, model, cfg, device, precision):
        require_process_group(self.name)
        super().__init__(model, cfg, device, precision)
        self.model = self.step_model = self._shard(model)

    def _mixed_precision(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.precision.enabled:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.precision.dtype, reduce_dtype=self.reduce_dtype
        )

    def _shard(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        cfg = self.cfg
        broadcast_from_rank0(model)
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        kwargs = dict(
            mesh=mesh,
            reshard_after_forward=cfg.FSDP.RESHARD_AFTER_FORWARD,
            mp_policy=self._mixed_precision(),
            offload_policy=CPUOffloadPolicy() if cfg.FSDP.CPU_OFFLOAD else OffloadPolicy(),
        )
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def _collective_device(self):
        # CPU-offloaded shards have their gradients (and overflow checks) on the host
        return torch.device("cpu") if self.cfg.FSDP.CPU_OFFLOAD else self.device

    def make_scaler(self):
        return AgreeingLossScaler.for_precision(self.precision, self._collective_device())

    @contextlib.contextmanager
    def no_sync(self, sync=False):
        # FSDP2 keeps unsharded gradients until a synchronising backward
        if sync:
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _after_eval(self):
        # Without RESHARD_AFTER_FORWARD a forward leaves the gathered parameters registered;
        # the EMA and the optimizer work on the shards
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def full_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)
