"""TRAIN.PARALLEL tensor: a model (the ViT) over a device mesh of MESH.PP x MESH.DP x MESH.TP
processes, cut by its own parallel plan (``pycls.models.parallel_plans``).

In the order torchtitan applies them: tensor and sequence parallelism over ``tp``
(``tensor_plan.parallelize_vit``), then FSDP2 over ``dp`` (a unit per block and the root, as
TRAIN.PARALLEL fsdp, also when dp is 1: its mixed-precision policy casts the weights for compute
and keeps the fp32 shards as master weights; with MESH.DP_REPLICATE replicas, HSDP over
``dp_replicate x dp_shard``), then, with MESH.PP > 1, pipeline stages (``tensor_pipeline``).

Data. Every process loads its own shard of each batch, as under DDP (the decoding work is spread
over all processes). The processes of a tensor-parallel group all-gather their shards into one
batch, which each of them runs (every process of a group computes the same logits), and each
hands the trainer the logits and mean loss of its own shard, so the meters count every sample
once, on the process that loaded it. The loss the backward sees is the group's batch mean; FSDP2
averages over the dp groups: the gradient of the global batch's mean loss, as in one process.

Weights. As under FSDP2, only rank 0 builds the model's weights (on the host; the others build it
on the meta device); every process parallelises the meta model, allocates its own parts and
receives them from rank 0 (``set_model_state_dict`` with ``broadcast_from_rank0``: one tensor at
a time). The qkv rows are reordered for the mesh on the way in (``tensor_plan.QKVLayout``) and
back in every checkpoint, export and import: files hold the model's own layout, so a checkpoint
written on one mesh resumes on any other (tp=2 -> tp=1, dp x tp -> dp, any engine).
"""

import contextlib
import logging

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from pycls import distributed as dist
from pycls.distributed.mesh import build_mesh, fsdp_mesh, mesh_shape, replicas
from pycls.engines.base import host_weights, require_process_group, rows
from pycls.engines.fsdp import FSDPEngine, log_replicas
from pycls.engines.mesh_traffic import TrafficShape, padded
from pycls.models.parallel_plans import parallel_plan

# DTensor notes each 2-D redistribution done in two collectives (the gradient norm, a full tensor
# for a checkpoint): a few per step at most, not worth a line of the log each
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def traffic_shape(model, plan, settings, mesh, precision, reduce_dtype):
    """The numbers of ``mesh_traffic.TrafficShape`` of a model parallelised over ``mesh["tp"]`` by
    its ``plan``, for the batch the settings give."""
    m = settings.mesh
    pp = mesh["pp"].size()
    dp = fsdp_mesh(mesh).size()
    params = dict(model.named_parameters())
    replicated = set(plan.replicated_parameter_names())
    split = sum(p.to_local().numel() for n, p in params.items() if n not in replicated)
    whole = [rows(p) for n, p in params.items() if n in replicated]
    shard = dp // (mesh["dp_replicate"].size() if "dp_replicate" in mesh.mesh_dim_names else 1)
    half = precision.dtype.itemsize if precision.enabled else 4
    return TrafficShape(
        **plan.traffic_dims(),
        images=m.batch_size // dp // m.accum_steps,
        accum_steps=m.accum_steps,
        split_params=split // pp,  # a stage's share, the blocks cut evenly
        whole_params=sum(r * n for r, n in whole),
        whole_shard=padded(whole, shard) // shard,
        act_bytes=half,
        param_bytes=half,
        reduce_bytes=reduce_dtype.itemsize,
        reshard_after_forward=settings.fsdp.reshard_after_forward,
    )


class TensorParallelEngine(FSDPEngine):
    name = "tensor"
    empty_batches_need_a_pass = False  # TRAIN.PARALLEL tensor refuses DATA_LOADER.SKIP_CORRUPT

    def __init__(self, model, settings, device, precision):
        require_process_group(self.name)
        m, world = settings.mesh, dist.get_world_size()
        _, dp, tp = mesh_shape(world, m.dp, m.tp, m.pp)  # MESH.PP > 1 is tensor_pipeline's
        self.replicate = replicas(m.dp_replicate, dp, tp)
        self.mesh = build_mesh(device.type, world, m.dp, m.tp, m.pp, self.replicate)
        self.tp_group = self.mesh.get_group("tp")
        self.tp_size = self.mesh["tp"].size()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.plan = parallel_plan(model, self.name)
        self.checkpoint_layout = self.plan.checkpoint_layout(self.tp_size)
        super().__init__(model, settings, device, precision)

    # -- building ------------------------------------------------------------------------------ #
    def _shard(self, model):
        weights = host_weights(model)  # rank 0's initial (or TRAIN.WEIGHTS) weights
        model.to_empty(device="meta")
        self.plan.parallelize_tensors(self.mesh["tp"])
        self._replicated = self.plan.replicated_parameter_names()
        dp, tp = fsdp_mesh(self.mesh).size(), self.tp_size
        log_replicas(self.replicate, dp)
        self._report_traffic(
            lambda: self._fsdp_traffic(model, self.replicate, dp, self._traffic_shape(model), tp)
        )
        self._fully_shard(model, fsdp_mesh(self.mesh))
        self._materialise(model, weights)
        return model

    def _traffic_shape(self, model):
        args = (self.settings, self.mesh, self.precision, self.reduce_dtype)
        return traffic_shape(model, self.plan, *args)

    @torch.no_grad()
    def _materialise(self, model, weights):
        """Allocates this process's parts of the parallelised meta model and fills them with rank
        0's ``weights`` (the qkv rows reordered for the mesh), one tensor at a time."""
        offload = self.settings.fsdp.cpu_offload
        model.to_empty(device="cpu" if offload else self.device)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(self.device))
        persistent = set(model.state_dict())
        full = {}
        if dist.is_main_proc():
            full = {k: v for k, v in weights.items() if k in persistent}
            full = self.checkpoint_layout.convert_state({"model": full}, to_mesh=True)["model"]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        for name, buf in model.named_buffers():  # non-persistent buffers: not in a state dict
            if name not in persistent:
                if dist.is_main_proc():
                    buf.copy_(weights[name])
                torch.distributed.broadcast(buf, src=0)

    # -- one step ------------------------------------------------------------------------------ #
    def _gather(self, tensor):
        """The tensor-parallel group's batch: the shards of its processes, in rank order."""
        if self.tp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts)

    def _own_rows(self, rows, shard):
        return rows.narrow(0, self.tp_rank * shard, shard)

    def _forward_backward(self, images, targets, loss_fn, scaler, loss_scale):
        p, shard = self.precision, images.shape[0]
        batch, all_targets = self._gather(images), self._gather(targets)
        with p.autocast():
            logits = self.step_model(p.cast_input(batch))
        loss = loss_fn(logits.float(), all_targets)
        scaler.scale(loss * loss_scale if loss_scale != 1.0 else loss).backward()
        logits = self._own_rows(logits.detach(), shard)
        if self.tp_size > 1:
            with torch.no_grad():
                loss = loss_fn(logits.float(), targets)
        return loss.detach(), logits

    def step(self, optimizer, scaler, clip_grad=0.0):
        self._agree_on_replicated_gradients()
        super().step(optimizer, scaler, clip_grad)

    @torch.no_grad()
    def _agree_on_replicated_gradients(self):
        """The replicated parameters' gradients of the group's first process in every process of
        the group: equal by construction, but a kernel that is not bitwise deterministic (some GPU
        convolutions' weight gradients) would otherwise let the copies drift apart."""
        if self.tp_size == 1:
            return
        params = dict(self.model.named_parameters())
        for name in self._replicated:
            grad = params[name].grad
            if grad is not None:
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                torch.distributed.broadcast(local, group=self.tp_group, group_src=0)

    # -- evaluation and state ------------------------------------------------------------------ #
    @contextlib.contextmanager
    def evaluating(self):
        with super().evaluating() as model:
            yield lambda images: self._own_rows(model(self._gather(images)), images.shape[0])

    def full_state_dict(self):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return self.checkpoint_layout.convert_state({"model": state}, to_mesh=False)["model"]
