"""The engine handle: what the trainer asks of the model, whichever engine holds it.

``parallelize`` returns an ``Engine``; the trainer, the range test and the timing harness call
only this interface:

- ``model`` (what the forward calls), ``module`` (the nn.Module that names the parameters: the
  optimizer, the EMA and the curriculum work on it), ``image_size``;
- ``optimizer_master_weights``, ``make_scaler()``, ``compile()``;
- ``forward_backward(images, targets, loss_fn, scaler, loss_scale, sync)``: one micro-batch, with
  the gradient sync skipped when ``sync`` is False (accumulation). An empty micro-batch (every
  image corrupt) still takes part in the collectives, with zero gradients, and returns None.
  The model may return a pair of logits (a distilled ViT while training): the loss takes the
  pair, the returned logits are their mean;
- ``step(optimizer, scaler, clip_grad)``: unscale, clip the global norm, step, update the scale;
- ``resize(size, optimizer, ema)``: the curriculum's new image size (re-wrapping if needed);
- ``evaluating()``: a context in eval mode yielding the callable model; ``train()``;
- ``full_state_dict()``: the whole model's weights on rank 0 (every process calls it);
- ``save(...)`` / ``load(...)`` / ``load_weights(path)``: the engine's checkpoint layout, with
  each process's own RNG state;
- ``any(flag)`` / ``all(flag)``: a decision every process takes together (range-test stop,
  preemption), so that no process leaves a loop its peers are still in.

This class is also the behaviour of a model in one process; each engine overrides what differs.
"""

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pycls import distributed as dist
from pycls.checkpoint import sharded, single_file
from pycls.engines import support
from pycls.engines.mesh_traffic import Unit, describe
from pycls.engines.resize import set_image_size

logger = logging.getLogger(__name__)


class Engine:
    name = "none"
    holds_master_weights = False  # FSDP's fp32 shards are the master weights
    # FSDP2 and the pipeline take the model as built (the host model on rank 0, a meta-device
    # model elsewhere: ``model_init_device``) and materialise only each process's shard or stage
    builds_from_rank0 = False
    empty_batches_need_a_pass = False  # processes meet in collectives during the backward
    # What converts tensors held in another layout than the model's to and from checkpoint files
    # (pycls.checkpoint.sharded: ``layout``); None where every tensor is in the model's own
    checkpoint_layout = None
    # Bytes per optimizer step and process over each mesh dimension (pycls.engines.mesh_traffic),
    # logged at start; None in one process, or without a batch size to size it
    traffic = None

    def __init__(self, model, settings, device, precision):
        self.settings, self.device, self.precision = settings, device, precision
        self.model = model
        self.step_model = model  # torch.compile'd by compile(), once the weights are loaded

    # -- what the trainer builds around the model ------------------------------------------ #
    @property
    def module(self):
        return self.model

    @property
    def image_size(self):
        return self.module.image_size

    @property
    def optimizer_master_weights(self):
        """Whether the optimizer keeps fp32 copies (AMP O2, unless the engine holds them)."""
        return self.precision.master_weights and not self.holds_master_weights

    def make_scaler(self):
        return self.precision.make_scaler(self.device)

    def compile(self):
        """torch.compile as the settings' ``compile`` and ``compile_scope`` say
        (``compile_model``); called again after a resize, where new shapes recompile."""
        self.step_model = self.model
        s = self.settings
        if s.compile:
            options = compile_kwargs(s.compile_mode, s.compile_coordinate_descent)
            self.step_model = compile_model(self.model, s.compile_scope, self.module, **options)
        return self.step_model

    def _report_traffic(self, estimate):
        """Keeps and logs (rank 0) what ``estimate()`` returns, where the settings give a batch
        to size it (``MeshSettings.batch_size``)."""
        if self.settings.mesh.batch_size == 0:
            return
        self.traffic = estimate()
        if dist.is_main_proc():
            logger.info(describe(self.traffic))

    @property
    def compute_bytes(self):
        """Bytes of an element in the compute dtype: what FSDP2 gathers, the activations."""
        return self.precision.dtype.itemsize if self.precision.enabled else 4

    @property
    def reduce_dtype(self):
        """The dtype gradients are averaged in: fp32, or the AMP dtype when asked."""
        if self.settings.reduce_in_compute_dtype and self.precision.enabled:
            return self.precision.dtype
        return torch.float32

    # -- one step ---------------------------------------------------------------------------- #
    @contextlib.contextmanager
    def no_sync(self, sync=False):
        """With ``sync`` False the backward passes inside keep their gradients local."""
        yield

    def forward_backward(self, images, targets, loss_fn, scaler, loss_scale=1.0, sync=True):
        """Forward under autocast, loss in fp32, scaled backward of one micro-batch; returns the
        detached (loss, logits), or None for an empty micro-batch."""
        empty = targets.shape[0] == 0
        if empty and not self.empty_batches_need_a_pass:
            return None
        if empty:  # a stand-in image with a zero loss: the collectives of the backward still run
            images, targets, loss_scale = self._stand_in(images), targets.new_zeros(1), 0.0
        with self.no_sync(sync):
            out = self._forward_backward(images, targets, loss_fn, scaler, loss_scale)
        return None if empty else out

    def _stand_in(self, images):
        size = self.image_size
        return torch.zeros((1, images.shape[1], size, size), device=self.device)

    def _forward_backward(self, images, targets, loss_fn, scaler, loss_scale):
        p = self.precision
        with p.autocast():
            out = self.step_model(p.cast_input(images))
        loss = loss_fn(_fp32(out), targets)
        scaler.scale(loss * loss_scale if loss_scale != 1.0 else loss).backward()
        return loss.detach(), predictions(out).detach()

    def clip_grad_norm_(self, optimizer, max_norm):
        """Clips the global gradient norm; returns it."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def step(self, optimizer, scaler, clip_grad=0.0):
        """Unscale and clip if asked, step (skipped on a float16 overflow), update the scale."""
        if clip_grad > 0:
            scaler.unscale_(optimizer)
            self.clip_grad_norm_(optimizer, clip_grad)
        scaler.step(optimizer)
        scaler.update()

    # -- curriculum and evaluation ------------------------------------------------------------ #
    def resize(self, size, optimizer=None, ema=None):
        """Switches the model to ``size`` px with its optimizer state and EMA; returns whether
        anything changed."""
        if not set_image_size(self.module, size, optimizer, ema):
            return False
        self._rewrap()
        self.compile()
        return True

    def _rewrap(self):
        """Wraps the resized module anew where the engine sized anything for the old shape."""

    @contextlib.contextmanager
    def evaluating(self):
        """Eval mode within the block; yields the callable model."""
        self.model.eval()
        try:
            yield self.step_model
        finally:
            self._after_eval()

    def _after_eval(self):
        """Puts the parameters back as training and the EMA expect them."""

    def train(self):
        self.model.train()

    # -- state --------------------------------------------------------------------------------- #
    def full_state_dict(self):
        """The whole model's state dict (full tensors) on rank 0; every process must call it.
        Other ranks get a (possibly partial) dict they should not use."""
        return self.module.state_dict()

    def save(
        self, out_dir, epoch, it=0, *, optimizer, scaler=None, cfg_yaml="", extra=None, writer=None
    ):
        """Writes the checkpoint after ``epoch`` epochs (and ``it`` steps of the next); every
        process calls it. Returns the path on rank 0, None elsewhere. ``writer`` (a
        ``pycls.checkpoint.async_writes.Writer``): the state is staged in host memory and
        written in the background (the path returned is the one it will have).

        Here: one file that rank 0 writes, with the RNG state of every process."""
        rng_states = gather_to_rank0(single_file.capture_rng_state())
        path = None
        if dist.is_main_proc():
            extra = {**(extra or {}), "world_size": dist.get_world_size()}
            path = single_file.save_checkpoint(
                out_dir,
                epoch,
                it=it,
                model=self.module,
                optimizer=optimizer,
                scaler=scaler,
                cfg_yaml=cfg_yaml,
                extra=extra,
                rng_states=rng_states,
                writer=writer,
            )
        # Nobody runs ahead (and, say, exits) before the file is complete (written in the
        # background: staged; the trainer's wait then agrees on its end)
        dist.barrier()
        return path

    def load(self, path, state, *, optimizer=None, scaler=None, restore_rng=True, folder=None):
        """Restores a checkpoint of either layout (``state`` from ``sharded.read_state``)
        into this engine; returns ``state`` (a sharded folder's EMA tensors filled in).
        ``folder``: whether it is a sharded folder, as decided where it was opened (None: look)."""
        if folder is None:
            folder = sharded.is_sharded_checkpoint(path)
        if folder:
            sharded.restore_sharded(
                path, state, self.module, optimizer, restore_rng, layout=self.checkpoint_layout
            )
        else:
            self._load_file(path, state, optimizer)
            if restore_rng:
                single_file.restore_own_rng_state(state, dist.get_rank())
        if scaler is not None and state.get("scaler_state"):
            scaler.load_state_dict(state["scaler_state"])
        return state

    def _load_file(self, path, state, optimizer):
        """A single-file checkpoint (full tensors) into this engine's model and optimizer."""
        if optimizer is not None:
            refuse_fairscale_optimizer(path, state, self.name)
        single_file.restore_checkpoint(path, state, model=self.module, optimizer=optimizer)

    def load_weights(self, path):
        """Only the weights of a checkpoint of either layout (TRAIN.WEIGHTS)."""
        return self.load(path, sharded.read_state(path), restore_rng=False)

    # -- decisions every process takes together ---------------------------------------------- #
    def any(self, flag):
        """Whether ``flag`` is true in any process (a collective: all processes call it)."""
        if dist.get_world_size() == 1:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], device=self._collective_device())
        return bool(dist.all_reduce_max(t).item())

    def all(self, flag):
        """Whether ``flag`` is true in every process (a collective)."""
        return not self.any(not flag)

    def _collective_device(self):
        return self.device


class WrapperNoSync:
    """``no_sync`` for engines whose wrapped model has its own ``no_sync()`` (DDP, FairScale,
    the pipeline's replicas): gradients stay local until the step that syncs."""

    @contextlib.contextmanager
    def no_sync(self, sync=False):
        if sync:
            yield
            return
        with self.model.no_sync():
            yield


class ShardedFolderState:
    """Checkpoints as torch.distributed.checkpoint folders, each process writing its part (FSDP2,
    the pipeline); a single-file checkpoint loads into the shards or stages too."""

    def save(
        self, out_dir, epoch, it=0, *, optimizer, scaler=None, cfg_yaml="", extra=None, writer=None
    ):
        return sharded.save_sharded(
            out_dir,
            epoch,
            it=it,
            module=self.model,
            optimizer=optimizer,
            scaler=scaler,
            cfg_yaml=cfg_yaml,
            extra=extra,
            layout=self.checkpoint_layout,
            writer=writer,
        )

    def _load_file(self, path, state, optimizer):
        if optimizer is not None:
            refuse_fairscale_optimizer(path, state, self.name)
        sharded.load_full_into(path, state, self.model, optimizer, layout=self.checkpoint_layout)
        ema, layout = state.get("ema_state"), self.checkpoint_layout
        if layout is not None and ema is not None and "tensors" in ema:  # the file's layout
            tensors = {n: layout.convert(n, t, to_mesh=True) for n, t in ema["tensors"].items()}
            state["ema_state"] = {**ema, "tensors": tensors}


def refuse_fairscale_optimizer(path, state, engine):
    """FairScale's optimizer state is one shard per process of flat tensors, which no other
    engine can map onto its parameters: resuming from it elsewhere is an error (not an optimizer
    silently started afresh), with the two ways out."""
    shards = (state.get("optimizer_state") or {}).get("shards")
    if shards is None:
        return
    raise single_file.CheckpointError(
        f"checkpoint {path} holds FairScale's optimizer state (flat shards of {len(shards)} "
        f"processes), which {support.ENGINES[engine]} cannot resume: resume it with "
        f"{support.ENGINES['fairscale']} on {len(shards)} processes, or start from its weights "
        "with TRAIN.WEIGHTS in a new OUT_DIR"
    )


def _fp32(out):
    """The model's output for the loss in fp32: logits, or a distilled ViT's pair of them."""
    return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()


def predictions(out):
    """The logits a model's output predicts: a distilled ViT's pair averaged, as in evaluation."""
    return sum(out) / len(out) if isinstance(out, tuple) else out


def gather_to_rank0(obj):
    """Every rank's ``obj`` (tensors moved to the CPU first), as a list on rank 0 (None
    elsewhere); a one-element list in a single process."""
    obj = sharded.to_cpu(obj)
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.is_main_proc() else None
    torch.distributed.gather_object(obj, out, dst=0)
    return out


@torch.no_grad()
def broadcast_from_rank0(model):
    """Copies rank 0's parameters and buffers to every process (ranks seed their RNG
    differently, so they initialise different models; only DDP broadcasts by itself)."""
    if dist.get_world_size() == 1:
        return model
    for tensor in [*model.parameters(), *model.buffers()]:
        torch.distributed.broadcast(tensor.data, src=0)
    return model


def host_weights(model):
    """On rank 0, the parameters and buffers (non-persistent ones too) of its host-built model by
    name, detached (they keep their storage when the model moves to the meta device); an empty
    dict on the other ranks."""
    if dist.get_rank() != 0:
        return {}
    return {name: t.detach() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def require_process_group(name):
    if not dist.is_initialized():
        raise RuntimeError(
            f"TRAIN.PARALLEL={name} needs a process group: launch with torchrun or set NUM_PROCS"
        )


def compile_kwargs(mode="default", coordinate_descent=False):
    """torch.compile's keyword arguments for a mode (TRAIN.COMPILE_MODE) and inductor's
    coordinate-descent tuning (TRAIN.COMPILE_COORDINATE_DESCENT): none for the defaults, so
    that the default compile stays torch's own. torch.compile takes a mode or options, not both:
    with the tuning, the mode's options (``torch._inductor.list_mode_options``) plus it."""
    if not coordinate_descent:
        return {} if mode == "default" else {"mode": mode}
    options = dict(torch._inductor.list_mode_options(mode)) if mode != "default" else {}
    options["coordinate_descent_tuning"] = True
    return {"options": options}


def compile_model(model, scope, unwrapped=None, backend="inductor", **kwargs):
    """The model to call for training: ``scope`` "blocks" compiles each of the repeated blocks
    of ``unwrapped`` (the model inside an engine's wrapper; default ``model``) in place and
    returns ``model`` (regional compilation: blocks of one shape share one compiled graph, so
    compiling takes a fraction of the whole model's time, and the wrapper's hooks stay
    outside the graphs); "model" returns ``torch.compile(model)``, one graph. ``backend``: what
    torch.compile compiles the graphs with; ``kwargs`` go to torch.compile too
    (``compile_kwargs``)."""
    if scope == "model":
        return torch.compile(model, backend=backend, **kwargs)
    blocks = (unwrapped or model).repeated_blocks()
    # Blocks that differ in a constant of their graph (a drop-path skip's kept count) each need
    # a graph: past dynamo's recompile limit (8) the remaining blocks would silently run eager
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), len(blocks) + 2))
    for block in blocks:
        block.compile(backend=backend, **kwargs)
    return model


def rows(tensor):
    """``(rows, rest)`` of a parameter as this process holds it before FSDP2 cuts it (a DTensor's
    local part): its first dimension and the product of the others."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    first = local.shape[0] if local.dim() else 1
    return first, local.numel() // max(first, 1)


def fsdp_units(model, param_bytes, own_units=()):
    """The parameters of each FSDP unit as ``mesh_traffic.Unit``s, in the order the engines wrap
    them: a module of ``own_units``' types on its own (in fp32), each repeated block, then the
    root's remaining parameters."""
    taken, units = set(), []

    def unit(params, nbytes):
        params = [p for p in params if id(p) not in taken]
        taken.update(id(p) for p in params)
        shapes = tuple(rows(p) for p in params)
        grads = tuple(rows(p) for p in params if p.requires_grad)
        units.append(Unit(shapes, grads, nbytes))

    for module in model.modules():
        if own_units and isinstance(module, own_units):
            unit(module.parameters(), 4)
    for block in model.repeated_blocks():
        unit(block.parameters(), param_bytes)
    unit(model.parameters(), param_bytes)
    return [u for u in units if u.shapes]
