"""TRAIN.PARALLEL tensor with MESH.PP > 1: pipeline stages (pycls.engines.pipeline) whose blocks are
tensor-parallel (pycls.models.vit.tensor_plan), with data-parallel replicas.

The mesh is ``pp x dp x tp`` (pycls.distributed.mesh). The whole meta model is parallelised over
``tp`` first, then cut into chunks as the pipeline engine cuts it; a stage is the ``tp`` processes
that hold the same chunks. Between stages the activation travels as each process's sequence shard
(a plain tensor: the pipeline's send and receive buffers), which the next stage takes up again as
the same sequence-sharded DTensor.

Data: every process loads its own shard; a pipeline replica runs the shards of its ``pp x tp``
processes as one batch (gathered over tp, then over pp), and each process gets the logits and
mean loss of its own shard back from the last stage. The replicas average their stages'
gradients after the step, as the pipeline engine's do (no FSDP2 across replicas here).
"""

import contextlib

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pycls import distributed as dist
from pycls.distributed.mesh import build_mesh
from pycls.engines.base import Engine, gather_to_rank0, host_weights, require_process_group
from pycls.engines.mesh_traffic import step_traffic
from pycls.engines.pipeline import PipelinedModel, PipelineEngine
from pycls.engines.tensor_parallel import traffic_shape
from pycls.models.parallel_plans import parallel_plan


class TensorParallelStages(PipelinedModel):
    """This process's chunks of a tensor-parallel model, run by the pipeline's schedules over the
    ``pp`` processes that hold the same tensor-parallel slice."""

    def __init__(self, model, plan, chunk_ids, ranges, *, mesh, **kwargs):
        self.tp_mesh = mesh["tp"]
        self.tp_group, self.tp_size = mesh.get_group("tp"), mesh["tp"].size()
        self.tp_rank = mesh["tp"].get_local_rank()
        super().__init__(
            model, plan, chunk_ids, ranges, pp_group=mesh.get_group("pp"),
            dp_group=mesh.get_group("dp"), **kwargs,
        )  # fmt: skip
        self.seq_dim, self._plan = plan.sequence_dim, plan
        self._tokens = None  # of the images of the running step
        for chunk in self.chunks:
            if not chunk.first:
                chunk.register_forward_pre_hook(self._take_up)
            if not chunk.last:
                chunk.register_forward_hook(self._hand_on)

    # -- stage boundaries -------------------------------------------------------------------- #
    def _take_up(self, chunk, args):
        """A received sequence shard as the sequence-sharded DTensor the blocks expect."""
        (x,) = args
        if isinstance(x, DTensor):
            return None
        shape = list(x.shape)
        shape[self.seq_dim] = self._tokens
        stride = torch.empty(shape, device="meta").stride()
        return (
            DTensor.from_local(
                x, self.tp_mesh, [Shard(self.seq_dim)], shape=torch.Size(shape), stride=stride
            ),
        )

    @staticmethod
    def _hand_on(chunk, args, out):
        return out.to_local().contiguous() if isinstance(out, DTensor) else out

    def _set_tokens(self, images):
        h, w = images.shape[-2:]
        self._tokens = self._plan.tokens(h, w)

    # -- data -------------------------------------------------------------------------------- #
    def _gather(self, tensor):
        """The replica's batch: the shards of its processes, gathered over tp then over pp."""
        if self.tp_size > 1:
            parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
            torch_dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
            tensor = torch.cat(parts)
        return super()._gather(tensor)

    def _scatter(self, rows, shard, width):
        """Each process's ``shard`` rows of the last stage's: the rows of process (stage i, tp
        rank t) are the (i * tp + t)-th block, handed by the last stage of the same tp rank."""
        if rows is not None and self.tp_size > 1:
            blocks = rows.split(shard)
            rows = torch.cat([blocks[i * self.tp_size + self.tp_rank] for i in range(self.pp_size)])
        return super()._scatter(rows, shard, width)

    def forward_backward(self, images, targets, loss_fn, precision, scaler, loss_scale=1.0):
        self._set_tokens(images)
        return super().forward_backward(images, targets, loss_fn, precision, scaler, loss_scale)

    def forward(self, images):
        self._set_tokens(images)
        return super().forward(images)

    # -- gradients --------------------------------------------------------------------------- #
    @torch.no_grad()
    def _average_gradients(self):
        """The replicas' mean of each gradient's local part."""
        grads = []
        for p in self.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        by_dtype = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group]).to(self.reduce_dtype)
            torch_dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.dp_size)
            for g, f in zip(group, flat.split([g.numel() for g in group])):
                g.copy_(f.view_as(g))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Clips the gradient norm of the whole model (every stage, every tp slice)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        sq = norm.float().square()
        torch_dist.all_reduce(sq, group=self.pp_group)  # stages hold disjoint parameters
        total = sq.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.dtype))
        return total

    # -- weights ----------------------------------------------------------------------------- #
    @torch.no_grad()
    def materialise(self, weights):
        """Allocates this process's parts of the meta chunks and fills them from rank 0's
        ``weights`` (name -> whole host tensor, rank 0 only; the qkv rows in the mesh's order):
        rank 0 sends each whole tensor to the processes that hold some of it, each keeps its
        part."""
        own = self._allocate_own()
        wanted = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(wanted, {n: (t.dtype, tuple(t.shape)) for n, t in own.items()})
        rank = torch_dist.get_rank()
        for name in sorted(set().union(*wanted)):  # one order in every process
            owners = [r for r, names in enumerate(wanted) if name in names]
            dtype, shape = wanted[owners[0]][name]
            if rank == 0:
                whole = weights[name].to(self.device, dtype).contiguous()
                for r in owners:
                    if r != 0:
                        torch_dist.send(whole, r)
            elif name in own:
                whole = torch.empty(shape, dtype=dtype, device=self.device)
                torch_dist.recv(whole, src=0)
            if name in own:
                _fill(own[name], whole)


def _fill(target, whole):
    """``target`` (a tensor, or a DTensor's local part) set from the whole tensor."""
    if isinstance(target, DTensor):
        part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(whole)


class TensorParallelPipelineEngine(PipelineEngine):
    name = "tensor"

    def __init__(self, model, settings, device, precision):
        require_process_group(self.name)
        m, p = settings.mesh, settings.pipeline
        self.mesh = build_mesh(device.type, dist.get_world_size(), m.dp, m.tp, m.pp)
        tp, pp = self.mesh["tp"].size(), self.mesh["pp"].size()
        plan = parallel_plan(model, self.name)
        self.checkpoint_layout = plan.checkpoint_layout(tp)
        weights = host_weights(model)  # rank 0's initial (or TRAIN.WEIGHTS) weights, fp32
        if dist.is_main_proc():
            weights = self.checkpoint_layout.convert_state({"model": weights}, to_mesh=True)
            weights = weights["model"]
        model = precision.prepare_model(model.to_empty(device="meta"))
        Engine.__init__(self, model, settings, device, precision)
        plan.parallelize_tensors(self.mesh["tp"])
        args = (model, plan, settings, self.mesh, precision, self.reduce_dtype)
        dp = self.mesh["dp"].size()
        self._report_traffic(lambda: step_traffic(traffic_shape(*args), dp, tp, pp))
        num_chunks = pp * p.stages_per_rank
        ranges = plan.chunk_ranges(num_chunks, p.balance)
        position = self.mesh["pp"].get_local_rank()
        self.model = self.step_model = TensorParallelStages(
            model,
            plan,
            list(range(position, num_chunks, pp)),
            ranges,
            mesh=self.mesh,
            device=device,
            schedule=p.schedule,
            micro_batches=p.micro_batches,
            autocast=precision.autocast if precision else contextlib.nullcontext,
            reduce_dtype=self.reduce_dtype,
        )
        self.model.materialise(weights)

    def full_state_dict(self):
        """The whole model's weights on rank 0 (in the model's layout); every process calls it."""
        part = {}
        for name, t in self.model.state_dict().items():
            part[name] = t.full_tensor() if isinstance(t, DTensor) else t
        merged = {}
        for piece in gather_to_rank0(part) or []:
            merged.update(piece)
        return self.checkpoint_layout.convert_state({"model": merged}, to_mesh=False)["model"]
