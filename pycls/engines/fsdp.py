"""TRAIN.PARALLEL fsdp (FSDP.BACKEND torch): FSDP2, ``fully_shard`` per block and on the root.

Parameters keep their names and become DTensor shards, which the foreach optimizer updates
directly. Under AMP the model is not cast: the fp32 shards are the master weights and the policy
casts gathered parameters to half for compute, reducing gradients in AMP.REDUCE_DTYPE. Batch
norms are units of their own with an fp32 policy below O3, as AMP O2 keeps them in one process:
their running statistics stay fp32 buffers, which the CPU kernel refuses next to half weights.

No process holds the whole model on the device: only rank 0 builds its weights, on the host; the
others build it on the meta device. Every process shards the meta model, allocates its own shard
and rank 0 scatters the weights one tensor at a time (``_materialise``).

HSDP (MESH.DP_REPLICATE): on a 2-D mesh of replicas x shards (``pycls.distributed.mesh``), FSDP2
shards within each group of consecutive processes (a machine, by default under torchrun and srun)
and all-reduces the gradient shards across the groups, as torchtitan's data_parallel_replicate
degree does (torchtitan/distributed/parallel_dims.py).
"""

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Replicate, Shard

from pycls import distributed as dist
from pycls.distributed.mesh import data_parallel_mesh, replicas
from pycls.engines import float8
from pycls.engines.base import (
    Engine,
    ShardedFolderState,
    fsdp_units,
    host_weights,
    require_process_group,
)
from pycls.engines.loss_scaling import AgreeingLossScaler
from pycls.engines.mesh_traffic import fsdp_traffic, step_traffic

logger = logging.getLogger(__name__)


class FSDPEngine(ShardedFolderState, Engine):
    name = "fsdp"
    holds_master_weights = True
    empty_batches_need_a_pass = True
    builds_from_rank0 = True

    def __init__(self, model, settings, device, precision):
        require_process_group(self.name)
        super().__init__(model, settings, device, precision)
        self.model = self.step_model = self._shard(model)

    def _mixed_precision(self):
        if not self.precision.enabled:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.precision.dtype, reduce_dtype=self.reduce_dtype
        )

    def _fp32_norms(self):
        """Whether batch norms get fp32 units of their own (AMP O1 and O2; O3 is half throughout).
        Their input stays as it comes: half from a convolution under autocast, which batch norm
        accepts with fp32 parameters."""
        return self.precision.enabled and self.precision.level != "O3"

    def _shard(self, model):
        weights = host_weights(model)  # rank 0's initial (or TRAIN.WEIGHTS) weights
        model.to_empty(device="meta")  # rank 0's too: sharding moves no whole block to the device
        world = dist.get_world_size()
        replicate = replicas(self.settings.mesh.dp_replicate, world)
        self.dp_mesh = data_parallel_mesh(self.device.type, world, replicate)
        log_replicas(replicate, world)
        self._report_traffic(lambda: self._fsdp_traffic(model, replicate, world))
        self._fully_shard(model, self.dp_mesh)
        self._materialise(model, weights)
        return model

    def _fsdp_traffic(self, model, replicate, dp, shape=None, tp=1):
        """What FSDP2 (HSDP with ``replicate`` > 1) over ``dp`` processes sends per step
        (``mesh_traffic``), from the units ``_fully_shard`` is about to make of ``model``; with a
        TrafficShape ``shape``, tensor parallelism's over ``tp`` too."""
        own = (nn.modules.batchnorm._BatchNorm,) if self._fp32_norms() else ()
        units = fsdp_units(model, self.compute_bytes, own)
        if shape is not None:
            return step_traffic(shape, dp, tp, units=units, replicate=replicate)
        s = self.settings
        return fsdp_traffic(
            units,
            replicate,
            dp // replicate,
            s.mesh.accum_steps,
            self.reduce_dtype.itemsize,
            s.fsdp.reshard_after_forward,
        )

    def _fully_shard(self, model, mesh):
        """FSDP2 over ``mesh`` (1-D, or 2-D: replicas x shards): a unit per repeated block (and
        per batch norm, in fp32 below O3), then the root."""
        fsdp = self.settings.fsdp
        kwargs = dict(
            mesh=mesh,
            reshard_after_forward=fsdp.reshard_after_forward,
            mp_policy=self._mixed_precision(),
            offload_policy=CPUOffloadPolicy() if fsdp.cpu_offload else OffloadPolicy(),
        )
        # One unit per transformer block, or per residual block of a CNN
        units = model.repeated_blocks()
        if self._fp32_norms():
            # Sharded before their blocks, so each block's unit leaves their parameters to them
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=False)
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    fully_shard(module, **{**kwargs, "mp_policy": fp32})
        for block in units:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)

    @torch.no_grad()
    def _materialise(self, model, weights):
        """Allocates this process's shards (and the buffers) of the sharded meta model and fills
        them with rank 0's ``weights`` (name -> host tensor, rank 0 only): each parameter's dim-0
        slices scattered as FSDP2 cuts them, each buffer broadcast."""
        offload = self.settings.fsdp.cpu_offload
        # CPU offload keeps the shards on the host and the buffers on the device, as fully_shard
        # places a model built with storage
        model.to_empty(device="cpu" if offload else self.device)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(self.device))
        for name, param in model.named_parameters():
            _scatter_shard(param, weights.get(name), self.device)
        for name, buf in model.named_buffers():
            if dist.is_main_proc():
                buf.copy_(weights[name])
            torch.distributed.broadcast(buf, src=0)

    def _collective_device(self):
        # CPU-offloaded shards have their gradients (and overflow checks) on the host
        return torch.device("cpu") if self.settings.fsdp.cpu_offload else self.device

    def make_scaler(self):
        return AgreeingLossScaler.for_precision(self.precision, self._collective_device())

    def step(self, optimizer, scaler, clip_grad=0.0):
        super().step(optimizer, scaler, clip_grad)
        if self.settings.float8 == "tensorwise" and self.device.type == "cuda":
            float8.precompute_scales(self.model)  # the next float8 all-gather's, one all-reduce

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

    @torch.no_grad()
    def _share_rank0_buffers(self):
        """Rank 0's buffers (batch norm's running statistics) on every process, as DDP broadcasts
        them: each process updates its own from its share of the batch, but an evaluation and a
        checkpoint (which keeps one process's copy of a replicated tensor) must see one set."""
        for buf in self.model.buffers():
            torch.distributed.broadcast(buf, src=0)

    @contextlib.contextmanager
    def evaluating(self):
        self._share_rank0_buffers()
        with super().evaluating() as model:
            yield model

    def save(self, *args, **kwargs):
        self._share_rank0_buffers()
        return super().save(*args, **kwargs)

    def _after_eval(self):
        # Without RESHARD_AFTER_FORWARD a forward leaves the gathered parameters registered;
        # the EMA and the optimizer work on the shards

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def full_state_dict(self):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)


def log_replicas(replicate, world):
    """Says (rank 0) how FSDP2 splits the processes where it keeps replicas (HSDP)."""
    if replicate > 1 and dist.is_main_proc():
        logger.info(
            f"HSDP: FSDP2 shards within {replicate} groups of {world // replicate} consecutive "
            f"processes and the groups average their gradients (MESH.DP_REPLICATE {replicate})"
        )


def _scatter_shard(param, full, device):
    """Rank 0's ``full`` tensor (None elsewhere) into ``param``, an FSDP2 DTensor sharded on dim 0
    over the last dimension of its mesh (of n processes) and replicated over the others: the
    process at shard coordinate c gets the c-th of ``full.chunk(n)`` (padded to equal sizes for
    the scatter), so no other process allocates more than its shard."""
    mesh = param.device_mesh
    if param.placements != (Replicate(),) * (mesh.ndim - 1) + (Shard(0),):
        raise NotImplementedError(f"FSDP2 placement {param.placements} (expected Shard(0))")
    local = param.to_local()
    n, coordinate = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    rows = param.shape[0]
    size = -(-rows // n)  # torch.chunk's: the last shards may hold fewer rows, or none
    mine = max(0, min(size, rows - coordinate * size))
    if local.shape[0] != mine:
        shape = tuple(param.shape)
        raise RuntimeError(f"FSDP2 shard of {shape}: {local.shape[0]} rows, not {mine}")
    padded = (size, *param.shape[1:])
    chunks = None
    if dist.get_rank() == 0:
        # Plain tensors for the collective whatever ``full`` is (a float8 layer's weight is a
        # torchao tensor subclass, which copy_ unwraps and the collectives cannot send)
        parts = [torch.zeros(padded, dtype=local.dtype, device=device) for _ in range(n)]
        for chunk, part in zip(parts, full.split(size)):
            chunk[: part.shape[0]].copy_(part)
        # Every replica's process at coordinate c receives the same part (one copy on rank 0)
        chunks = [None] * dist.get_world_size()
        for i, rank in enumerate(mesh.mesh.flatten().tolist()):
            chunks[rank] = parts[i % n]
    received = torch.empty(padded, dtype=local.dtype, device=device)
    torch.distributed.scatter(received, chunks, src=0)
    local.copy_(received[:mine])
