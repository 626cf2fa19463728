"""TRAIN.PARALLEL pipeline: a model cut into stages over PIPELINE.STAGES processes (the cut is
the model's own parallel plan: ``pycls.models.parallel_plans``; the ViT's chunks:
``pycls.models.vit.pipeline_cut``), run by torch.distributed.pipelining, data-parallel over the
rest. Checkpoints are sharded folders.

No process holds the whole model on the device: only rank 0 builds its weights, on the host; the
others build it on the meta device. Every process cuts the meta model, allocates its own stages
and receives their weights from rank 0 (``PipelinedModel.materialise``).

Layout. The world is ``dp x pp`` processes, pp = PIPELINE.STAGES. Rank r is pipeline position
``r % pp`` of data-parallel replica ``r // pp`` (a pipeline's neighbours are adjacent ranks, so they
share a node when they can). The model is cut into ``pp * v`` chunks, v = PIPELINE.STAGES_PER_RANK;
position p holds chunks p, p + pp, p + 2 pp, ... (the looped layout of interleaved schedules).

Names. A chunk registers the model's own submodules under their own names, and
``PipelinedModel`` (what the trainer holds) registers the union of this rank's chunks the same
way: its state dict is the slice of the whole model's state dict that this rank owns, with the
same keys, so weight-decay groups, sharded checkpoints and single-file weights all line up.

Data and meters. Every process loads its own shard of each batch, as under DDP (so the decoding
work is spread over all processes). A pipeline gathers the shards of its processes into one
replica batch (an all-gather of the images and targets over the pipeline group), runs it, and
hands each process the logits of its own shard back (a scatter from the last stage, with the
shard's mean loss), so the trainer's meters count every sample once, on the process that loaded
it, exactly as with DDP. The replica batch is the global batch / replicas, as with one process.

Steps. ``forward_backward`` runs one schedule step (GPipe, 1F1B or interleaved 1F1B over
PIPELINE.MICRO_BATCHES micro-batches of the replica batch); the loss is computed on the last stage.
``forward`` is the forward-only schedule used for evaluation. With several replicas, the gradients
of each stage are averaged over its replicas after the step (one all-reduce per dtype over the
data-parallel group; ``no_sync()`` skips it for accumulation steps). This is DDP's arithmetic
without its bucketed overlap: DDP's reducer inside pipelining schedules proved fragile (its
bucket bookkeeping sees the hooks of several backward passes per step).
"""

import contextlib

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.device_mesh import init_device_mesh

from pycls import distributed as dist
from pycls.engines.base import (
    Engine,
    ShardedFolderState,
    WrapperNoSync,
    gather_to_rank0,
    host_weights,
    require_process_group,
)
from pycls.engines.loss_scaling import AgreeingLossScaler
from pycls.engines.mesh_traffic import pipeline_traffic
from pycls.models.parallel_plans import parallel_plan

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


# ------------------------------------------------------------------------------------------------ #
# The engine
# ------------------------------------------------------------------------------------------------ #


class PipelineEngine(WrapperNoSync, ShardedFolderState, Engine):
    name = "pipeline"
    builds_from_rank0 = True

    def __init__(self, model, settings, device, precision):
        require_process_group(self.name)
        weights = host_weights(model)  # rank 0's initial (or TRAIN.WEIGHTS) weights, fp32
        # rank 0's model too is cut on the meta device, cast for the AMP level (shapes and dtypes)
        model = precision.prepare_model(model.to_empty(device="meta"))
        super().__init__(model, settings, device, precision)
        dims = parallel_plan(model, self.name).traffic_dims()
        self.model = self.step_model = apply_pipeline(
            model, settings.pipeline, device, precision, reduce_dtype=self.reduce_dtype
        )
        self._report_traffic(lambda: self._pipeline_traffic(dims))
        self.model.materialise(weights)

    def _pipeline_traffic(self, dims):
        """What this process sends per step (``mesh_traffic.pipeline_traffic``): the activations
        of its replica's batch at a stage boundary, its stage's gradients over the replicas."""
        m, stages = self.settings.mesh, self.settings.pipeline.stages
        replicas = dist.get_world_size() // stages
        images = m.batch_size // replicas
        activation = images * dims["tokens"] * dims["width"] * self.compute_bytes
        grads = [p for p in self.model.parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() for p in grads) * self.reduce_dtype.itemsize
        per_micro = activation / m.accum_steps
        return pipeline_traffic(grad_bytes, replicas, per_micro, stages, m.accum_steps)

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


class _DenseGradient(torch.autograd.Function):
    """The identity, its gradient made contiguous: what a stage sends back to the one before it
    travels through a receive buffer of its strides, which the collectives want dense. A stage's
    input gradient can come out strided: the residual stream carries the gradient of the last
    stage's first strided op back unchanged (an RMSNorm's backward, the attention pool's
    transposes)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _dense_input_gradient(chunk, args):
    return tuple(_DenseGradient.apply(a) if isinstance(a, torch.Tensor) else a for a in args)


# ------------------------------------------------------------------------------------------------ #
# The model the trainer holds
# ------------------------------------------------------------------------------------------------ #


class PipelinedModel(nn.Module):
    """This rank's chunks of a model, with the steps that run the whole pipeline.

    Args:
        model: the whole model (its blocks that other ranks own are dropped here).
        plan: its parallel plan (``pycls.models.parallel_plans``), which cuts it into chunks.
        chunk_ids: the chunks this rank runs (global chunk indices, ascending).
        ranges: the blocks of every chunk (``plan.chunk_ranges``).
        pp_group, dp_group: this rank's pipeline and data-parallel process groups.
        device: where the chunks live. schedule: one of SCHEDULES. micro_batches: per step.
        autocast: callable returning the forward's autocast context.
        reduce_dtype: the dtype gradients are averaged over the replicas in (AMP.REDUCE_DTYPE).
    """

    def __init__(
        self,
        model,
        plan,
        chunk_ids,
        ranges,
        *,
        pp_group,
        dp_group,
        device,
        schedule="1f1b",
        micro_batches=4,
        autocast=contextlib.nullcontext,
        reduce_dtype=torch.float32,
    ):
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"PIPELINE.SCHEDULE: {schedule!r} is not one of {list(SCHEDULES)}")
        self.num_chunks = len(ranges)
        self.chunk_ids = list(chunk_ids)
        self.schedule_name, self.micro_batches = schedule, micro_batches
        self.pp_group, self.dp_group, self.device = pp_group, dp_group, device
        self.pp_size = torch_dist.get_world_size(pp_group)
        self.num_classes = model.num_classes
        self.has_first = 0 in self.chunk_ids
        self.has_last = self.num_chunks - 1 in self.chunk_ids
        self.chunks = [
            plan.chunk(ranges[c], c == 0, c == self.num_chunks - 1) for c in self.chunk_ids
        ]
        for chunk in self.chunks:
            chunk.autocast = autocast
            if not chunk.first:
                chunk.register_forward_pre_hook(_dense_input_gradient)
        self._register_union(self.chunks)
        # The whole model's names: single-file optimizer state is numbered in their order
        self.whole_model_names = [name for name, _ in model.named_parameters()]
        self.whole_model_no_decay = model.no_weight_decay_names()
        own = {name for name, _ in self.named_parameters()}
        self._no_decay = {n for n in self.whole_model_no_decay if n in own}
        self.complexity = model.complexity  # of the whole model: FLOPs per image are per pipeline
        self.whole_model_image_size = model.image_size
        plan.drop_blocks()  # free the blocks no chunk of this rank holds
        self.dp_size = 1 if dp_group is None else torch_dist.get_world_size(dp_group)
        self._sync_gradients = True
        self.reduce_dtype = reduce_dtype  # of the gradient mean over replicas
        self._schedules = {}
        self._step = None  # what the loss function of the running training step needs

    def _register_union(self, chunks):
        self.blocks = nn.ModuleDict()
        for chunk in chunks:
            for name, module in chunk.named_children():
                if name == "blocks":
                    self.blocks.update(module)
                else:
                    self.add_module(name, module)
            for name, p in chunk.named_parameters(recurse=False):
                self.register_parameter(name, p)
            for name, b in chunk.named_buffers(recurse=False):
                self.register_buffer(name, b)

    @torch.no_grad()
    def _allocate_own(self):
        """Allocates this process's meta parameters and buffers on its device, in place (the same
        tensor objects, as the chunks and the model's embedding and head code share them), tells
        the chunks; returns them by name."""
        own = dict([*self.named_parameters(), *self.named_buffers()])
        for t in own.values():
            if t.is_meta:
                new = torch.empty_like(t, device=self.device)
                if isinstance(t, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=t.requires_grad)
                torch.utils.swap_tensors(t, new)
        for chunk in self.chunks:
            chunk.materialised()
        return own

    @torch.no_grad()
    def materialise(self, weights):
        """Allocates this rank's chunks of a model built on the meta device and fills them with
        rank 0's ``weights`` (whole-model name -> host tensor, on rank 0 only): rank 0 sends each
        tensor, cast to the stage's dtype (the AMP level's), to the processes that hold it. No
        process allocates another stage's tensors on its device."""
        own = self._allocate_own()
        wanted = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(wanted, {name: t.dtype for name, t in own.items()})
        rank = torch_dist.get_rank()
        for name in sorted(set().union(*wanted)):  # one order in every process
            owners = [r for r, names in enumerate(wanted) if name in names]
            if rank == 0:
                t = weights[name].to(self.device, wanted[owners[0]][name]).contiguous()
                for r in owners:
                    if r == 0:
                        own[name].copy_(t)
                    else:
                        torch_dist.send(t, r)
            elif name in own:
                local = own[name]
                buffer = local if local.is_contiguous() else torch.empty_like(local)
                torch_dist.recv(buffer, src=0)
                if buffer is not local:
                    local.copy_(buffer)

    @torch.no_grad()
    def _average_gradients(self):
        """Mean of the gradients over the data-parallel replicas of this rank's stages."""
        params = [p for p in self.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # the other replicas may have one: take part with zeros
                p.grad = torch.zeros_like(p)
        by_dtype = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads]).to(self.reduce_dtype)
            torch_dist.all_reduce(flat, group=self.dp_group)
            flat.div_(self.dp_size)
            torch._foreach_copy_(
                grads,
                [
                    f.view_as(g).to(g.dtype)
                    for f, g in zip(flat.split([g.numel() for g in grads]), grads)
                ],
            )

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of the steps inside stay on each replica (accumulation); the first step
        after the block averages everything accumulated."""
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = True

    # -- what the optimizer, checkpoints and the trainer ask -------------------------------- #
    @property
    def image_size(self):
        return self.whole_model_image_size

    def no_weight_decay_names(self):
        return set(self._no_decay)

    def repeated_blocks(self):
        """This process's blocks, of all its chunks (what regional compilation compiles)."""
        return [block for chunk in self.chunks for block in chunk.blocks.values()]

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads this rank's slice of a whole-model state dict (other stages' keys are skipped)."""
        own = set(self.state_dict().keys())
        mine = {k: v for k, v in state_dict.items() if k in own}
        return super().load_state_dict(mine, strict=strict, assign=assign)

    # -- schedules ------------------------------------------------------------------------- #
    def _schedule(self, train, batch_shape):
        """One schedule (and its stages) per input shape: stage buffers are sized on first use."""
        key = (train, tuple(batch_shape))
        if key not in self._schedules:
            stages = [
                pipelining.PipelineStage(
                    module, c, self.num_chunks, self.device, group=self.pp_group
                )
                for module, c in zip(self.chunks, self.chunk_ids)
            ]
            loss_fn = self._loss if train else None
            cls = {
                "gpipe": pipelining.ScheduleGPipe,
                "1f1b": pipelining.Schedule1F1B,
                "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
            }[self.schedule_name]
            stage_arg = stages if self.schedule_name == "interleaved_1f1b" else stages[0]
            # The loss is divided by the micro-batch count here (not the gradients afterwards, which
            # would also divide what earlier accumulation steps left in them)
            self._schedules[key] = cls(
                stage_arg, n_microbatches=self.micro_batches, loss_fn=loss_fn, scale_grads=False
            )
        return self._schedules[key]

    def _loss(self, logits, targets):
        """Loss of one micro-batch on the last stage as the backward needs it: divided by the
        micro-batch count and the accumulation steps, then scaled for float16."""
        step = self._step
        loss = step["loss_fn"](logits.float(), targets)
        return step["scaler"].scale(loss * (step["loss_scale"] / self.micro_batches))

    def _gather(self, tensor):
        """The pipeline's replica batch: the shards of its processes, in pipeline order."""
        if self.pp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.pp_size)]
        torch_dist.all_gather(parts, tensor.contiguous(), group=self.pp_group)
        return torch.cat(parts)

    def _scatter(self, rows, shard, width):
        """Each process's ``shard`` rows of the last stage's ``rows`` (ignored elsewhere)."""
        if self.pp_size == 1:
            return rows.float()
        out = torch.empty((shard, width), dtype=torch.float32, device=self.device)
        parts = list(rows.float().split(shard)) if self.has_last else None
        src = torch_dist.get_global_rank(self.pp_group, self.pp_size - 1)
        torch_dist.scatter(out, parts, src=src, group=self.pp_group)
        return out

    def forward_backward(self, images, targets, loss_fn, precision, scaler, loss_scale=1.0):
        """One training step's forward and backward through the pipeline.

        ``images`` and ``targets`` are this process's shard. Returns the shard's (mean loss,
        logits), as an unsplit model would, on every process. Gradients end up in the parameters,
        averaged over the micro-batches (and over the replicas); ``loss_scale`` divides
        the loss of one of several accumulated micro-batches.
        """
        shard = images.shape[0]
        batch, all_targets = self._gather(images), self._gather(targets)
        if batch.shape[0] % self.micro_batches:
            raise ValueError(
                f"PIPELINE.MICRO_BATCHES: a replica batch of {batch.shape[0]} images does not "
                f"split into {self.micro_batches} micro-batches"
            )
        schedule = self._schedule(True, batch.shape)
        self._step = {"loss_fn": loss_fn, "scaler": scaler, "loss_scale": loss_scale}
        try:
            args = (precision.cast_input(batch),) if self.has_first else ()
            logits = schedule.step(*args, target=all_targets if self.has_last else None)
        finally:
            self._step = None
        if self.dp_size > 1 and self._sync_gradients:
            self._average_gradients()
        rows = None
        if self.has_last:  # [logits | mean loss of the shard the row belongs to]
            logits = logits.detach().float()
            with torch.no_grad():
                losses = [
                    loss_fn(lg, t) for lg, t in zip(logits.split(shard), all_targets.split(shard))
                ]
            shard_loss = torch.stack(losses).repeat_interleave(shard)
            rows = torch.cat([logits, shard_loss[:, None]], dim=1)
        mine = self._scatter(rows, shard, self.num_classes + 1)
        return mine[0, -1], mine[:, :-1]

    def forward(self, images):
        """Forward-only pipeline (evaluation) of this process's shard; returns its logits.

        A replica batch that does not split into the micro-batches is padded (the padding's
        logits are dropped), so the last, smaller batch of an evaluation also runs.
        """
        if self.training and torch.is_grad_enabled():
            raise RuntimeError("a pipelined model trains through forward_backward(), not forward()")
        shard = images.shape[0]
        batch = self._gather(images)
        n, m = batch.shape[0], self.micro_batches
        padded = -(-max(n, m) // m) * m
        if padded != n:
            batch = torch.cat([batch, batch.new_zeros((padded - n, *batch.shape[1:]))])
        schedule = self._schedule(False, batch.shape)
        with torch.no_grad():
            logits = schedule.eval(*((batch,) if self.has_first else ()))
        rows = logits[:n] if self.has_last else None
        return self._scatter(rows, shard, self.num_classes)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Clips the gradient norm of the whole model (all stages); returns the norm."""
        by_dtype = {}
        for p in self.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for grads in by_dtype.values():
            sq += torch.stack(torch._foreach_norm(grads)).float().square().sum()
        torch_dist.all_reduce(sq, group=self.pp_group)  # stages hold disjoint parameters
        total = sq.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(dtype))
        return total


# ------------------------------------------------------------------------------------------------ #
# Building it from a config
# ------------------------------------------------------------------------------------------------ #


def pipeline_groups(pp, world, device_type):
    """(pp_group, dp_group) of this rank: rank r is position r % pp of replica r // pp."""
    mesh = init_device_mesh(device_type, (world // pp, pp), mesh_dim_names=("dp", "pp"))
    return mesh.get_group("pp"), mesh.get_group("dp")


def apply_pipeline(model, settings, device, precision, reduce_dtype=torch.float32):
    """Splits ``model`` (on ``device``, a model with a parallel plan) over ``settings.stages``
    ranks (``settings``: a PipelineSettings)."""
    p = settings
    world, rank = dist.get_world_size(), dist.get_rank()
    pp = p.stages
    if world % pp:
        raise ValueError(f"PIPELINE.STAGES: {pp} does not divide the {world} processes")
    pp_group, dp_group = pipeline_groups(pp, world, device.type)
    num_chunks = pp * p.stages_per_rank
    plan = parallel_plan(model, "pipeline")
    ranges = plan.chunk_ranges(num_chunks, p.balance)
    position = rank % pp
    chunk_ids = list(range(position, num_chunks, pp))
    return PipelinedModel(
        model,
        plan,
        chunk_ids,
        ranges,
        pp_group=pp_group,
        dp_group=dp_group,
        device=device,
        schedule=p.schedule,
        micro_batches=p.micro_batches,
        autocast=precision.autocast if precision else contextlib.nullcontext,
        reduce_dtype=reduce_dtype,
    )
