"""The engine handle (pycls.engines) on the engine x feature matrix, and fixes where engines meet
features: per-rank RNG on resume, EMA under FSDP2 without resharding, range-test and skip-corrupt
decisions taken together, gradient reduction dtype, LAMB x FairScale, sampler seeds, mid-epoch
fast-forward, LR scaling with the curriculum's batch, the docs' table, no import cycles; timm's
optimizers under FSDP2 (which of them the config refuses there).

The matrix: engines ``none``, ``ddp``, ``fsdp``, ``pipeline`` x FEATURES (and the range test's
column), each cell (a) against one process, (b) stopped and resumed bitwise; (c) checkpoints
resumed under other engines and process counts. One spawn of 2 gloo processes runs every
multi-process case (results through files), then rank 0 alone runs the world-size-1 cases in a
process group of its own; ``none`` and the one-process references run here. Tiny model
(tests/helpers/distributed.py's TINY_GLOO), 4 steps per cell.
"""

import ast
import contextlib
import datetime
import math
import os
import pkgutil
import time

import pytest
import torch
from timm.optim import create_optimizer_v2
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import pycls
from pycls import distributed
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint import single_file as checkpoint
from pycls.config import ConfigError, validation
from pycls.optim.library_names import TIMM_NOT_UNDER_FSDP, TIMM_OPTIMIZERS
from tests.helpers import ROOT, scaled, tiny_quickstart
from tests.helpers.distributed import batches, spawn, tiny_cfg

STEPS, STOP = 4, 2  # steps of a cell; the resumed run stops after STOP and continues

# The engines of the matrix; ``none`` runs in this process, the others on 2 processes
ENGINES = {
    "none": ["TRAIN.PARALLEL", "none"],
    "ddp": ["TRAIN.PARALLEL", "ddp"],
    "fsdp": ["TRAIN.PARALLEL", "fsdp"],
    "pipeline": ["TRAIN.PARALLEL", "pipeline"],
}
PARALLEL = [e for e in ENGINES if e != "none"]
# The features of the matrix as config overrides. The LR range test (--mode lrfind) is a mode,
# not a key: its column is test_lrfind_curve_matches_one_process
FEATURES = {
    "plain": [],
    "ema": ["TRAIN.EMA", "True", "TRAIN.EMA_DECAY", "0.5", "TRAIN.EMA_WARMUP", "False"],
    # 8 px for steps 0-1, 16 px for 2-3 (each step an epoch of the schedule): the resumed run
    # loads an 8 px checkpoint and resamples its embedding, Adam moments and EMA at step 2
    "curriculum": [
        "CURRICULUM.ENABLED", "True", "CURRICULUM.START_SIZE", "8", "CURRICULUM.STEP", "8",
        "CURRICULUM.EPOCHS_PER_STEP", "2", "TRAIN.EMA", "True", "TRAIN.EMA_DECAY", "0.5",
        "TRAIN.EMA_WARMUP", "False",
    ],
    "accum": ["TRAIN.ACCUM_STEPS", "2"],
    "o2_bf16": ["AMP.LEVEL", "O2", "AMP.DTYPE", "bfloat16"],
    "lamb": ["OPTIM.OPTIMIZER", "lamb"],
    "no_clip": ["OPTIM.CLIP_GRAD", "0.0"],
    "mixup": ["MIXUP.ALPHA", "0.8"],
    "contiguous": ["OPTIM.CONTIGUOUS_PARAMS", "True"],
    "skip_corrupt": ["DATA_LOADER.SKIP_CORRUPT", "True"],
    # Other libraries' optimizers: Schedule-Free's checkpoints keep y beside its state
    "schedulefree": ["OPTIM.OPTIMIZER", "schedulefree_adamw", "OPTIM.LR_POLICY", "constant"],
    "timm_laprop": ["OPTIM.OPTIMIZER", "timm:laprop"],
    # The block features, many at once: the parallel block (its fused projections) with
    # RMSNorm QK-norm, LayerScale, axial RoPE, the attention pool and no bias anywhere; the
    # sequential block with a SwiGLU of two projections and its hidden norm, EVA's q and v
    # biases, a mixed RoPE (learned frequencies per head) and no position embedding
    "parallel_block": [
        "VIT.BLOCK", "parallel", "VIT.NORM_LAYER", "rms", "VIT.QK_NORM", "rms",
        "VIT.LAYER_SCALE_INIT", "0.5", "VIT.ROPE", "axial", "VIT.CLASSIFIER", "map",
        "VIT.QKV_BIAS", "False", "VIT.PROJ_BIAS", "False",
    ],
    "swiglu_rope": [
        "VIT.FFN", "swiglu", "VIT.FFN_WIDTH", "two_thirds", "VIT.FFN_NORM", "True",
        "VIT.KEY_BIAS", "False", "VIT.ROPE", "mixed", "VIT.POS_EMBED", "none",
        "VIT.QK_NORM", "layer", "VIT.LAYER_SCALE_INIT", "0.5",
    ],
    # The CNN zoo's row: a tiny AnyNet (batch norm, SE, group convolutions) in place of the ViT
    "cnn": [
        "MODEL.TYPE", "anynet", "ANYNET.STEM_TYPE", "res_stem_cifar", "ANYNET.STEM_W", "8",
        "ANYNET.BLOCK_TYPE", "res_bottleneck_block", "ANYNET.DEPTHS", "[1, 1]",
        "ANYNET.WIDTHS", "[16, 32]", "ANYNET.STRIDES", "[1, 2]", "ANYNET.BOT_MULS", "[1.0, 1.0]",
        "ANYNET.GROUP_WS", "[8, 8]", "ANYNET.SE_ON", "True",
    ],
}  # fmt: skip
# Float32 sums reordered by the engines: rounding, amplified a little by 4 steps. bfloat16 weights
# round each step: agreement to a few bf16 ulps of the loss. Unclipped Adam divides tiny gradients
# by their own scale, which magnifies their rounding (seen: 2.2e-5 on one element of 2048)
LOSS_RTOL = {"o2_bf16": 2e-2}
WEIGHT_ATOL = {"o2_bf16": 3e-2, "no_clip": 1e-4}


def cells():
    """(engine, feature) pairs the compatibility rule allows."""
    out = []
    for e, eo in ENGINES.items():
        for f, fo in FEATURES.items():
            try:
                tiny_cfg(*eo, *fo)
            except ConfigError:
                continue
            out.append((e, f))
    return out


def _mixed(images, labels, num_classes=10):
    """Soft targets of a fixed mix (the same in every process): what mixup hands the engines."""
    onehot = torch.nn.functional.one_hot(labels, num_classes).float()
    return 0.7 * images + 0.3 * images.flip(0), 0.7 * onehot + 0.3 * onehot.flip(0)


def build(cfg, seed=0):
    from pycls.core.builders import build_ema
    from pycls.core.trainer import build_training

    torch.manual_seed(seed + distributed.get_rank())  # ranks differ; engines start from rank 0's
    engine, optimizer, scaler, loss_fn, _ = build_training(cfg, torch.device("cpu"))
    return engine, optimizer, scaler, loss_fn, build_ema(cfg, engine.module)


def corrupt_first_micro_batch(step, rank, world):
    """SKIP_CORRUPT cells: whether this process's first micro-batch of ``step`` is all corrupt.
    On 2 processes rank 1's always is (it meets rank 0 in the collectives with nothing); alone,
    every other step's is (an empty batch: no step for its parameters)."""
    return rank == 1 if world > 1 else step % 2 == 1


def train(cfg, data, state, steps, rank=0, world=1):
    """Trainer steps ``steps`` (a range) of the global batches in ``data``, as train_epoch runs
    them (curriculum size, shard per process, micro-batches, EMA). Returns the global mean
    losses."""
    from pycls.core.builders import build_image_size_schedule

    engine, optimizer, scaler, loss_fn, ema = state
    accum, losses = cfg.TRAIN.ACCUM_STEPS, []
    sizes = build_image_size_schedule(cfg, world)
    for step in steps:
        images, labels = data[step]
        if cfg.CURRICULUM.ENABLED:  # one step per epoch of the schedule, as _apply_image_size
            size = sizes.size(step)
            engine.resize(size, optimizer, ema)
            images = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear")
        targets = labels
        if cfg.MIXUP.ALPHA > 0:
            images, targets = _mixed(images, labels)
        shard = images.shape[0] // world
        mine = slice(rank * shard, (rank + 1) * shard)
        optimizer.zero_grad(set_to_none=True)
        total, count = torch.zeros(()), torch.zeros(())
        micro = list(zip(images[mine].chunk(accum), targets[mine].chunk(accum)))
        for i, (x, y) in enumerate(micro):
            skip = cfg.DATA_LOADER.SKIP_CORRUPT and corrupt_first_micro_batch(step, rank, world)
            if skip and i == 0:
                x, y = x[:0], y[:0]
            out = engine.forward_backward(x, y, loss_fn, scaler, 1.0 / accum, sync=i == accum - 1)
            if out is not None:
                total += out[0].float() * x.shape[0]
                count += x.shape[0]
        engine.step(optimizer, scaler, cfg.OPTIM.CLIP_GRAD)
        if ema is not None:
            ema.update(engine.module)
        distributed.all_reduce_sum([total, count])
        losses.append(float(total / count))
    return losses


def save(state, out_dir):
    """Checkpoint after STOP steps as the trainer writes it (EMA and image size in the extras);
    the path on every process."""
    engine, optimizer, scaler, _, ema = state
    extra = {"im_size": engine.image_size}
    if ema is not None:
        extra["ema_state"] = ema.state_dict()
    path = engine.save(out_dir, 1, optimizer=optimizer, scaler=scaler, extra=extra)
    return distributed_broadcast(path)


def resume(cfg, path, seed=100):
    """A fresh engine (other initial weights) resumed from ``path`` as resume_or_init does:
    switched to the checkpoint's image size first, then loaded."""
    resumed = build(cfg, seed=seed)
    engine, optimizer, scaler, _, ema = resumed
    state = sharded_checkpoint.read_state(path)
    engine.resize(state.get("im_size", cfg.TRAIN.IM_SIZE), optimizer, ema)
    state = engine.load(path, state, optimizer=optimizer, scaler=scaler)
    if ema is not None:
        ema.load_state_dict(state["ema_state"])
    return resumed


def straight_and_resumed(cfg, data, out_dir, rank=0, world=1):
    """A cell: (a) STEPS steps straight; (b) STOP steps, checkpoint, a fresh engine resumes from
    it and runs the rest. Returns the losses and the full weights and EMA of both runs."""
    state = build(cfg)
    losses = train(cfg, data, state, range(STEPS), rank, world)
    straight = {"weights": state[0].full_state_dict(), "ema": _full_ema(state[4])}
    state = build(cfg)
    train(cfg, data, state, range(STOP), rank, world)
    resumed = resume(cfg, save(state, out_dir))
    sizes = (resumed[0].image_size,)
    train(cfg, data, resumed, range(STOP, STEPS), rank, world)
    again = {"weights": resumed[0].full_state_dict(), "ema": _full_ema(resumed[4])}
    sizes += (resumed[0].image_size,)
    return {"losses": losses, "straight": straight, "resumed": again, "sizes": sizes}


def _full_ema(ema):
    if ema is None:
        return {}
    full = {}
    for name, t in zip(ema.names, ema.tensors):
        full[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full


def _init(rank, world, port):
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=world + 1, is_master=False)
    # a hang (a process waiting in a collective its peers left) fails in 60 s instead
    torch.distributed.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=scaled(60)),
    )


# ------------------------------------------------------------------------------------------------ #
# The 2-process worker: every case, one process start
# ------------------------------------------------------------------------------------------------ #


def _worker(rank, world, port, out_dir):
    _init(rank, world, port)
    results = {"timings": {}}
    try:
        for name, case in _CASES.items():
            start = time.perf_counter()
            results[name] = case(rank, world, out_dir)
            results["timings"][name] = time.perf_counter() - start
        distributed.destroy_process_group()
        if rank == 0:
            start = time.perf_counter()
            results["alone"] = _alone(results)
            results["timings"]["alone"] = time.perf_counter() - start
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        if distributed.is_initialized():
            distributed.destroy_process_group()


def _matrix(rank, world, out_dir):
    """Every allowed cell of the parallel engines."""
    out = {}
    for engine_name, feature in cells():
        if engine_name == "none":
            continue
        cfg = tiny_cfg(*ENGINES[engine_name], *FEATURES[feature])
        cell_dir = os.path.join(out_dir, f"{engine_name}_{feature}")
        got = straight_and_resumed(cfg, batches(cfg, STEPS), cell_dir, rank, world)
        if rank == 0:
            out[engine_name, feature] = got
    return out


# (c) checkpoints written by one engine on 2 processes, resumed by another (or on another
# number of processes) after STOP steps: (source, destination) -> the destination's full weights
# once loaded and after the remaining steps. Sources: FSDP2 and pipeline folders, DDP's file.
CROSS = [
    ("fsdp", "ddp"), ("fsdp", "pipeline"), ("fsdp", "none"), ("fsdp", "fsdp_1"),
    ("pipeline", "fsdp"), ("pipeline", "none"), ("ddp", "fsdp"), ("ddp", "pipeline"),
    ("ddp", "none"),
]  # fmt: skip
# ``fsdp_1``: FSDP2 in a process group of one (rank 0 alone, after the 2-process cases)


def _cross_sources(rank, world, out_dir):
    """Each source engine trains STOP steps and checkpoints; its weights at that point."""
    out = {}
    for src in sorted({s for s, _ in CROSS}):
        cfg = tiny_cfg(*ENGINES[src])
        state = build(cfg)
        train(cfg, batches(cfg, STEPS), state, range(STOP), rank, world)
        path = save(state, os.path.join(out_dir, f"cross_{src}"))
        out[src] = {"path": path, "weights": state[0].full_state_dict()}
    return out


def _cross_resume(cross, dst, rank=0, world=1):
    """Every source checkpoint that ``dst`` resumes (2 processes, or one)."""
    cfg = tiny_cfg(*ENGINES[dst.removesuffix("_1")])
    out = {}
    for src, d in CROSS:
        if d == dst:
            resumed = resume(cfg, cross[src]["path"], seed=5)
            loaded = {k: v.clone() for k, v in resumed[0].full_state_dict().items()}  # not views
            train(cfg, batches(cfg, STEPS), resumed, range(STOP, STEPS), rank, world)
            out[src, dst] = {"loaded": loaded, "continued": resumed[0].full_state_dict()}
    return out


def fairscale_file(ddp_file, out_dir):
    """DDP's checkpoint with the optimizer state as FairScale writes it: one state dict of flat
    shards per process (the layout no other engine can read)."""
    state = checkpoint.load_file(ddp_file)
    state["optimizer_state"] = {"shards": [state["optimizer_state"]] * 2}
    return checkpoint.save_file(state, os.path.join(out_dir, "fairscale.pyth"))


def refusals(path, engines):
    """engine -> the message of the error resuming ``path`` under it stops with (None: it
    resumed)."""
    out = {}
    for engine in engines:
        try:
            resume(tiny_cfg(*ENGINES[engine]), path)
            out[engine] = None
        except checkpoint.CheckpointError as e:
            out[engine] = str(e)
    return out


def _cross(rank, world, out_dir):
    sources = _cross_sources(rank, world, out_dir)
    out = {}
    for dst in PARALLEL:
        out.update(_cross_resume(sources, dst, rank, world))
    path = fairscale_file(sources["ddp"]["path"], out_dir) if rank == 0 else None
    path = distributed_broadcast(path)
    return {"sources": sources, "resumed": out, "refused": refusals(path, PARALLEL)}


def _alone(results):
    """Rank 0 alone in a new process group of one: FSDP2 at world size 1 resumes the 2-process
    FSDP2 folder."""
    distributed.init_single_process_group("cpu")
    try:
        return _cross_resume(results["cross"]["sources"], "fsdp_1")
    finally:
        distributed.destroy_process_group()


def distributed_broadcast(obj):
    """Rank 0's ``obj`` on every process."""
    if distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _rng_per_rank(rank, world, out_dir):
    """Fix 1: DDP's single-file checkpoint gives each process its own RNG back."""
    cfg = tiny_cfg(*ENGINES["ddp"])
    engine, optimizer, scaler, _, _ = build(cfg)
    path = distributed_broadcast(engine.save(os.path.join(out_dir, "rng"), 1, optimizer=optimizer))
    after_save = torch.rand(4)
    torch.manual_seed(1234)  # the RNG moves on (or a fresh process starts)
    engine.load(path, sharded_checkpoint.read_state(path), optimizer=optimizer, scaler=scaler)
    return {"after_save": after_save, "after_load": torch.rand(4)}


@torch.no_grad()
def _fsdp_ema_eval(rank, world, out_dir):
    """Fix 2: EMA evaluation under FSDP2 with RESHARD_AFTER_FORWARD False (the eval forward
    leaves gathered parameters registered; the swap must see the shards)."""
    cfg = tiny_cfg(*ENGINES["fsdp"], "FSDP.RESHARD_AFTER_FORWARD", "False", *FEATURES["ema"])
    data = batches(cfg, 2)
    state = build(cfg)
    with torch.enable_grad():
        train(cfg, data, state, range(2), rank, world)
    engine, ema = state[0], state[4]
    x = data[0][0][rank * 4 : (rank + 1) * 4]
    # the full state dict is taken first: FSDP2's state-dict hooks re-register the shards and
    # would hide what the eval forward left behind, as the trainer's evaluation has no such call
    weights = engine.full_state_dict()
    with engine.evaluating() as model:
        raw = model(x)
    with ema.swapped_into(engine.module), engine.evaluating() as model:
        averaged = model(x)
    return {
        "raw": raw,
        "averaged": averaged,
        "ema": _full_ema(ema),
        "weights_before": weights,
        "weights_after": engine.full_state_dict(),
        "x": x,
    }


def _skip_corrupt(rank, world, out_dir):
    """Fix 5: a process whose micro-batch is all corrupt still meets its peers in the backward
    (DDP and FSDP2); its contribution is zero."""
    out = {}
    for name in ("ddp", "fsdp"):
        cfg = tiny_cfg(*ENGINES[name], "DATA_LOADER.SKIP_CORRUPT", "True", "OPTIM.CLIP_GRAD", "0")
        engine, optimizer, scaler, loss_fn, _ = build(cfg)
        x, y = batches(cfg, 1)[0]
        start = engine.full_state_dict()
        if rank == 1:
            x, y = x[:0], y[:0]
        got = engine.forward_backward(x[:4], y[:4], loss_fn, scaler)
        grads = {n: p.grad for n, p in engine.module.named_parameters()}
        grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
        out[name] = {"start": start, "grads": grads, "returned": got is not None}
    return out


def _lrfind(rank, world, out_dir):
    """Fix 4: one process wants to stop the range test at once, the other never: both stop."""
    from pycls.core.lr_finder import find_lr

    factor = "0.5" if rank == 1 else "1e9"  # 0.5: any loss exceeds half the minimum
    cfg = tiny_quickstart(
        os.path.join(out_dir, "lrfind"), "DEVICE", "cpu", "TRAIN.PARALLEL", "ddp",
        "LRFIND.NUM_ITERS", "4", "LRFIND.DIVERGE_FACTOR", factor,
    )  # fmt: skip
    return len(find_lr(cfg)["lrs"])


# The range test's column of the matrix: 5 iterations of the tiny quickstart (digits; the
# sampler's global batch and its augmentation seeds do not depend on the number of processes)
LRFIND = [
    "DEVICE", "cpu", "VIT.DEPTH", "2", "LRFIND.NUM_ITERS", "5", "LRFIND.START_LR", "1e-4",
    "LRFIND.END_LR", "1e-1", "LRFIND.DIVERGE_FACTOR", "1e9", "PIPELINE.MICRO_BATCHES", "4",
]  # fmt: skip


def lrfind_curve(out_dir, engine):
    from pycls.core.lr_finder import find_lr

    cfg = tiny_quickstart(os.path.join(out_dir, f"lrfind_{engine}"), *LRFIND, *ENGINES[engine])
    got = find_lr(cfg)
    return {"lrs": got["lrs"], "losses": got["losses"]}


def _lrfind_engines(rank, world, out_dir):
    return {engine: lrfind_curve(out_dir, engine) for engine in PARALLEL}


def _reduce_dtype(rank, world, out_dir):
    """Fix 10: DDP at O2 averages the bf16 gradients in fp32, as FSDP2 does."""
    cfg = tiny_cfg(*ENGINES["ddp"], *FEATURES["o2_bf16"])
    engine, optimizer, scaler, loss_fn, _ = build(cfg)
    x, y = batches(cfg, 1)[0]
    seen = []
    all_reduce = torch.distributed.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = spy
    try:
        engine.forward_backward(
            x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4], loss_fn, scaler
        )
    finally:
        torch.distributed.all_reduce = all_reduce
    fsdp = build(tiny_cfg(*ENGINES["fsdp"], "AMP.LEVEL", "O3"))[0]
    grad_dtypes = {p.grad.dtype for p in engine.module.parameters()}
    return {"ddp": set(seen), "grads": grad_dtypes, "fsdp": fsdp._mixed_precision().reduce_dtype}


# AMP.RESIDUAL_DTYPE under each engine: O1 in bfloat16, with and without the bfloat16 stream
RESIDUAL_ENGINES = {
    **{e: ENGINES[e] for e in PARALLEL},
    "tensor": ["TRAIN.PARALLEL", "tensor", "MESH.TP", "2"],
    "tensor_pp": ["TRAIN.PARALLEL", "tensor", "MESH.PP", "2"],
}
O1_BF16 = ["AMP.LEVEL", "O1", "AMP.DTYPE", "bfloat16"]


def _residual_dtype(rank, world, out_dir):
    """Each engine's first training steps at O1, with the bfloat16 residual stream and without
    (and the math attention kernel pinned, which changes nothing on the CPU): the dtype of every
    block's input (read by a hook inside the engine's wrappers), the parameters' dtype and the
    losses."""
    out = {}
    for name, overrides in RESIDUAL_ENGINES.items():
        for stream in ("float32", "bfloat16"):
            cfg = tiny_cfg(*overrides, *O1_BF16, "AMP.RESIDUAL_DTYPE", stream,
                           "VIT.ATTENTION_BACKEND", "math")  # fmt: skip
            state = build(cfg)
            seen = set()
            for block in state[0].module.repeated_blocks():
                block.register_forward_pre_hook(lambda m, args, seen=seen: seen.add(args[0].dtype))
            losses = train(cfg, batches(cfg, 3), state, range(3), rank, world)
            params = {p.dtype for p in state[0].module.parameters()}
            out[name, stream] = {"inputs": seen, "params": params, "losses": losses}
    return out


# FSDP2 and the pipeline build the model on the meta device except on rank 0.
# Each variant: (overrides, how the reference is built: None for the initial model of seed 0,
# "file"/"folder" for the TRAIN.WEIGHTS written first). sincos: the position table is a buffer;
# conv stem: BatchNorm buffers; O2: the pipeline's stages are cast
META_INIT = {
    "fsdp": ([*ENGINES["fsdp"]], None),
    "fsdp_buffers": ([*ENGINES["fsdp"], "VIT.POS_EMBED", "sincos", "VIT.STEM_TYPE", "conv",
                      "VIT.C_STEM_CHANNELS", "[8, 8]", "VIT.C_STEM_KERNELS", "[3, 3]",
                      "VIT.C_STEM_STRIDES", "[2, 2]", "VIT.NUM_REGISTERS", "1",
                      "VIT.FC_NORM", "True", "TRAIN.FREEZE", "last_1", "VIT.DROP_PATH", "0.3"],
                     None),
    "pipeline": ([*ENGINES["pipeline"]], None),
    "pipeline_o2_sincos": ([*ENGINES["pipeline"], *FEATURES["o2_bf16"], "VIT.POS_EMBED",
                            "sincos", "VIT.DROP_PATH", "0.3"], None),
    "fsdp_weights_file": ([*ENGINES["fsdp"]], "file"),
    "pipeline_weights_folder": ([*ENGINES["pipeline"]], "folder"),
}  # fmt: skip


class _Allocations(TorchDispatchMode):
    """Bytes of every tensor an op allocates on a real device (not views or in-place results;
    a DTensor counts its local shard) while ``on``."""

    def __init__(self):
        super().__init__()
        self.sizes, self.on = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and not any(r.alias_info is not None for r in func._schema.returns):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, DTensor):
                    t = t._local_tensor
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.sizes.append(t.numel() * t.element_size())
        return out


def _held_bytes(module, world):
    """Bytes of each tensor this process holds (a DTensor's padded dim-0 shard)."""
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if isinstance(t, DTensor):
            rows = -(-t.shape[0] // world)
            out.append(rows * math.prod(t.shape[1:]) * t.element_size())
        else:
            out.append(t.numel() * t.element_size())
    return out


def _recording(allocations, fn, devices=None):
    """``fn`` recording what it allocates; for the model builder, also the device of the model
    it returns, to which it adds a non-persistent buffer (none of the ViT's is)."""

    def recorded(*args, **kwargs):
        allocations.on = True
        try:
            out = fn(*args, **kwargs)
            if devices is not None:
                devices.append(next(out.parameters()).device.type)
                extra = torch.arange(5.0) + 0.5  # on the meta device where the model is
                out.blocks[-1].register_buffer("extra", extra, persistent=False)
        finally:
            allocations.on = False
        return out

    return recorded


def _meta_init(rank, world, out_dir):
    """Item 8: the engines' model right after construction, gathered; what each process
    allocated while the trainer built the model and the engine (not the optimizer's master
    weights); the TRAIN.WEIGHTS each variant starts from."""
    from pycls.checkpoint import weight_files
    from pycls.core import builders, trainer

    reference = os.path.join(out_dir, "init_weights.safetensors")
    torch.manual_seed(7)  # a model other than the seed-0 one
    file_weights = builders.build_model(tiny_cfg()).state_dict()
    if rank == 0:
        weight_files.save_safetensors(file_weights, reference)
    fsdp = build(tiny_cfg(*ENGINES["fsdp"]), seed=3)
    folder = fsdp[0].save(os.path.join(out_dir, "init"), 1, optimizer=fsdp[1])
    folder = distributed_broadcast(folder)
    sources = {"file": reference, "folder": folder}
    out = {"file": file_weights, "folder": fsdp[0].full_state_dict()}
    real_build, real_parallelize = builders.build_model, trainer.parallelize
    for name, (overrides, source) in META_INIT.items():
        extra = ["TRAIN.WEIGHTS", sources[source]] if source else []
        cfg = tiny_cfg(*overrides, *extra)
        devices, allocations = [], _Allocations()
        builders.build_model = _recording(allocations, real_build, devices)
        trainer.parallelize = _recording(allocations, real_parallelize)
        try:
            torch.manual_seed(rank)  # ranks differ; engines start from rank 0's
            with allocations:
                engine = trainer.build_training(cfg, torch.device("cpu"))[0]
        finally:
            builders.build_model, trainer.parallelize = real_build, real_parallelize
        out[name] = {
            "weights": engine.full_state_dict(),
            "params": {n for n, _ in engine.module.named_parameters()},
            "trainable": {n for n, p in engine.module.named_parameters() if p.requires_grad},
            "built_on": devices,
            "allocated": allocations.sizes,
            "held": _held_bytes(engine.module, world),
            "extra": {n: b for n, b in engine.module.named_buffers() if n.endswith(".extra")},
            "rates": {
                n: (b.dtype, b.item())
                for n, b in engine.module.named_buffers()
                if n.endswith("drop_path.keep_prob")
            },
        }
    return out


# timm's optimizers under FSDP2: two steps of each name on the 2-process model (ADOPT's first step
# only starts its moments), its weights against one process's. Those failing on one process only
# (an empty shard) would leave the other waiting in a collective: they are checked in one process
# (test_timm_optimizers_that_fail_on_empty_shards)
EMPTY_SHARD_FAILURES = ("adamp", "sgdp")
# A step as one process takes it moves no weight by more than this; sign-based updates (Lion)
# flip on gradients that are zero but for rounding (a key's bias): a few elements move by lr
TIMM_FSDP_ATOL, TIMM_FSDP_SHARE = 1e-5, 0.01


def timm_step(name, rank=0, world=1):
    """Two steps of timm:``name`` on two global batches (FSDP2 with ``world`` > 1): the full
    weights after them, or the error raised."""
    engine = "fsdp" if world > 1 else "none"
    cfg = tiny_cfg("OPTIM.OPTIMIZER", f"timm:{name}")
    cfg.defrost()
    cfg.TRAIN.PARALLEL = engine  # the refused names too: the config would stop them
    engine, optimizer, scaler, loss_fn, _ = build(cfg)
    try:
        for images, labels in batches(cfg, 2):
            shard = images.shape[0] // world
            mine = slice(rank * shard, (rank + 1) * shard)
            optimizer.zero_grad(set_to_none=True)
            engine.forward_backward(images[mine], labels[mine], loss_fn, scaler)
            engine.step(optimizer, scaler, cfg.OPTIM.CLIP_GRAD)
    except Exception as e:  # what a refused name fails with, in both processes alike
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return engine.full_state_dict()


def _timm_fsdp(rank, world, out_dir):
    names = [n for n in TIMM_OPTIMIZERS if n not in EMPTY_SHARD_FAILURES]
    return {name: timm_step(name, rank, world) for name in names}


_CASES = {
    "meta_init": _meta_init,
    "rng": _rng_per_rank,
    "fsdp_ema": _fsdp_ema_eval,
    "skip_corrupt": _skip_corrupt,
    "lrfind": _lrfind,
    "lrfind_engines": _lrfind_engines,
    "reduce_dtype": _reduce_dtype,
    "residual_dtype": _residual_dtype,
    "matrix": _matrix,
    "cross": _cross,
    "timm_fsdp": _timm_fsdp,
}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("engines2"))
    start = time.perf_counter()
    spawn(_worker, 2, out)
    results = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in (0, 1)]
    print(f"2-process cases: {time.perf_counter() - start:.1f} s {results[0]['timings']}")
    return results


@pytest.fixture(scope="module")
def one_process(single_thread, tmp_path_factory):
    """Each feature in this process (engine ``none``): the reference of the parallel cells, and
    the ``none`` row of the matrix (its stopped and resumed run)."""
    out = tmp_path_factory.mktemp("engines1")
    refs = {}
    for feature in FEATURES:
        cfg = tiny_cfg(*FEATURES[feature])
        refs[feature] = straight_and_resumed(cfg, batches(cfg, STEPS), str(out / feature))
        refs[feature]["weights"] = refs[feature]["straight"]["weights"]
    return refs


@pytest.fixture(scope="module")
def lrfind_one_process(single_thread, tmp_path_factory):
    return lrfind_curve(str(tmp_path_factory.mktemp("lrfind1")), "none")


@pytest.fixture(scope="module")
def cross_alone(two, single_thread):
    """The 2-process checkpoints resumed here, in one process without a process group."""
    return _cross_resume(two[0]["cross"]["sources"], "none")


def _close(ours, ref, atol):
    assert set(ours) == set(ref)
    for k in ref:
        torch.testing.assert_close(
            ours[k].float(), ref[k].float(), atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}"
        )


# ------------------------------------------------------------------------------------------------ #
# The matrix
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("engine, feature", cells())
def test_matrix_cell_matches_one_process_and_resumes_bitwise(two, one_process, engine, feature):
    """(a) a few steps agree with one process (``none``: it is the reference); (b) stopped after
    STOP steps and resumed by a fresh engine: bitwise the weights (which the optimizer state
    shaped) and the EMA of the uninterrupted run under the same engine."""
    ref = one_process[feature]
    got = ref if engine == "none" else two[0]["matrix"][engine, feature]
    # SKIP_CORRUPT: rank 1's images are dropped, one process has them all: nothing to compare.
    # CNN: batch norm normalises each process's share, one process the whole batch (compared
    # with shares accumulated in one process in test_cnn_engines)
    if feature not in ("skip_corrupt", "cnn"):
        torch.testing.assert_close(
            torch.tensor(got["losses"]),
            torch.tensor(ref["losses"]),
            rtol=LOSS_RTOL.get(feature, 1e-5),
            atol=0,
        )
        _close(got["straight"]["weights"], ref["weights"], WEIGHT_ATOL.get(feature, 2e-5))
    cfg = tiny_cfg(*FEATURES[feature])
    assert bool(got["straight"]["ema"]) == cfg.TRAIN.EMA
    # the image size resumed at and ended with (the curriculum's checkpoint is at 8 px)
    assert got["sizes"] == ((8, 16) if cfg.CURRICULUM.ENABLED else (16, 16))
    for kind in ("weights", "ema"):
        a, b = got["straight"][kind], got["resumed"][kind]
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (kind, k)


def test_matrix_covers_every_engine_and_rejects_only_what_the_rule_says():
    allowed = set(cells())
    assert {e for e, _ in allowed} == set(ENGINES)
    rejected = {(e, f) for e in ENGINES for f in FEATURES} - allowed
    assert rejected == {
        ("fsdp", "contiguous"),
        ("pipeline", "skip_corrupt"),
        ("fsdp", "curriculum"),
        ("pipeline", "curriculum"),
        ("pipeline", "cnn"),
        ("pipeline", "schedulefree"),
        ("pipeline", "timm_laprop"),
    }
    for e, f in rejected:  # one rule, naming both keys
        with pytest.raises(ConfigError, match=rf"{ENGINES[e][0]} {ENGINES[e][1]}"):
            tiny_cfg(*ENGINES[e], *FEATURES[f])


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("engine", PARALLEL)
def test_lrfind_curve_matches_one_process(two, lrfind_one_process, engine):
    """The range test's column: the (lr, smoothed loss) curve of 2 processes is the one-process
    curve (global batch losses; float32 sums reordered). (b) does not apply: the range test
    writes no checkpoint and has nothing to resume (a stopped one is simply run again)."""
    ref = lrfind_one_process
    got = two[0]["lrfind_engines"][engine]
    assert len(got["lrs"]) == len(ref["lrs"]) == 5
    assert got["lrs"] == ref["lrs"]
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0
    )


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("src, dst", CROSS, ids=[f"{s}-to-{d}" for s, d in CROSS])
def test_checkpoint_resumes_under_another_engine_or_world_size(
    two, one_process, cross_alone, src, dst
):
    """(c) A checkpoint of ``src`` on 2 processes after STOP steps, resumed by ``dst`` (another
    engine, or FSDP2 on one process): bitwise the saved weights once loaded, and the remaining
    steps (with the optimizer state it restored) end where one process ends, within the
    tolerance of (a)."""
    cross = two[0]["cross"]
    if dst == "none":
        got = cross_alone[src, dst]
    elif dst == "fsdp_1":
        got = two[0]["alone"][src, dst]
    else:
        got = cross["resumed"][src, dst]
    saved = cross["sources"][src]["weights"]
    assert set(got["loaded"]) == set(saved)
    for k, v in saved.items():
        assert torch.equal(got["loaded"][k], v), k
    _close(got["continued"], one_process["plain"]["weights"], 2e-5)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_format_another_engine_cannot_read_stops_the_resume_naming_both(two, tmp_path):
    """FairScale's optimizer shards under any other engine (2 processes, and ``none`` here):
    an error naming the checkpoint, the engine and the ways out, not an optimizer silently
    started afresh."""
    path = fairscale_file(two[0]["cross"]["sources"]["ddp"]["path"], str(tmp_path))
    refused = {**two[0]["cross"]["refused"], **refusals(path, ["none"])}
    assert set(refused) == set(ENGINES)
    for engine, message in refused.items():
        assert message is not None, f"{engine} resumed"
        assert os.path.basename(path) in message and "FairScale" in message, engine
        assert f"{ENGINES[engine][0]} {ENGINES[engine][1]} cannot resume" in message, engine
        assert "TRAIN.WEIGHTS" in message


@pytest.mark.parametrize("feature", ["parallel_block", "swiglu_rope"])
def test_fsdp2_units_hold_each_block_features_parameters(tmp_path, feature):
    """FSDP2 shards one unit per block and the root: every parameter a block feature adds (the
    parallel block's fused projections, QK-norms, LayerScales, a mixed RoPE's frequencies, EVA's
    q and v biases, the hidden norm) is in its block's unit, gathered with the block, and the
    attention pool in the root's. Checked to fail with the blocks' units made of their
    attention alone (their other parameters then fall to the root)."""
    from torch.distributed.fsdp import FSDPModule

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = build(tiny_cfg(*ENGINES["fsdp"], *FEATURES[feature]))[0].module
        names = {id(p): n for n, p in model.named_parameters()}
        units = {}
        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                units[name] = {names[id(q.sharded_param)] for q in group.fsdp_params}
    finally:
        torch.distributed.destroy_process_group()
    blocks = [f"blocks.{i}" for i in range(4)]
    assert set(units) == {"", *blocks}
    for unit in blocks:
        assert units[unit] == {n for n in names.values() if n.startswith(unit + ".")}
    assert units[""] == {n for n in names.values() if not n.startswith("blocks.")}
    assert any(n.startswith("attn_pool.") for n in units[""]) == (feature == "parallel_block")
    held = {n.split(".", 2)[2] for n in units["blocks.0"]}
    want = {"in_proj.weight", "out_proj.weight", "q_norm.weight", "ls.gamma"}
    if feature == "swiglu_rope":
        want = {"attn.rope.freqs", "attn.q_bias", "ffn.fc1_g.weight", "ffn.norm.weight"}
    assert want <= held, want - held


class _OneProcessInstance(torch.nn.Module):
    """FairScale's FSDP instance as one process sees it, on the CPU (FairScale shards on CUDA
    only): its parameters are already whole, so gathering them is a no-op."""

    def __init__(self, module, flatten_parameters):
        super().__init__()
        assert not flatten_parameters  # the engine flattens into its own two groups
        self._fsdp_wrapped_module = module
        for p in module.parameters():
            p._is_sharded = True

    def summon_full_params(self, recurse=True, volatile=False):
        return contextlib.nullcontext()

    def forward(self, *args):
        return self._fsdp_wrapped_module(*args)


def fairscale_like(model):
    """The FairScale engine's wrapping (an instance per block and one on the root, each over a
    FlattenParamsWrapper of decay and no-decay parameters), with one-process instances."""
    from pycls.engines import fairscale
    from pycls.models.groups import no_weight_decay_names

    no_decay = {id(p) for n, p in model.named_parameters() if n in no_weight_decay_names(model)}
    for i, block in enumerate(model.blocks):
        model.blocks[i] = fairscale._grouped(block, no_decay, _OneProcessInstance, {})
    return fairscale._grouped(model, no_decay, _OneProcessInstance, {})


@pytest.mark.parametrize("feature", ["plain", "parallel_block", "swiglu_rope"])
def test_fairscale_loads_a_full_state_into_its_flat_parameters(feature):
    """A GPU run found FairScale's own load_state_dict asking our wrappers for flat parameters:
    the engine copies the full state in by name, through every wrapper, and refuses a mismatch.
    The block features go through FairScale's flattening as the standard block does (what the
    CPU can run of FairScale: its FlattenParamsWrapper, with one-process instances): the same
    logits, the same gradients, reaching every flat parameter. Checked to fail with a block
    reading a parameter it holds outside a Linear as the module's own attribute once (the
    wrapper gives views of its flat parameter at each forward)."""
    from pycls.engines.fairscale import load_full_state

    cfg = tiny_cfg(*FEATURES[feature])
    source, target = build(cfg)[0].module, build(cfg)[0].module
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(3, 3, 16, 16)
    want = source.eval()(x)
    state = source.state_dict()
    wrapped = fairscale_like(target).eval()
    assert not torch.allclose(wrapped(x), want)
    load_full_state(wrapped, state)
    torch.testing.assert_close(wrapped(x), want, rtol=0, atol=0)
    wrapped(x).square().sum().backward()
    want.square().sum().backward()
    flat = [p.grad for p in wrapped.parameters()]
    assert all(g is not None for g in flat)
    total = sum(g.square().sum() for g in flat)
    torch.testing.assert_close(total, sum(p.grad.square().sum() for p in source.parameters()))
    if feature != "plain":
        return
    with pytest.raises(KeyError, match="missing keys"):
        load_full_state(wrapped, {k: v for k, v in state.items() if k != "head.weight"})
    bad = {**state, "head.bias": torch.zeros(7)}
    with pytest.raises(RuntimeError, match="head.bias: shape"):
        load_full_state(wrapped, bad)


def test_fairscale_optimizer_shards_of_another_process_count_are_refused(tmp_path):
    """FairScale resumes its own shards on as many processes only (CUDA-only engine: its
    loading step alone, in one process)."""
    from types import SimpleNamespace

    from pycls.engines.fairscale import FairScaleEngine

    engine, optimizer, _, _, _ = build(tiny_cfg())
    state = {"model_state": engine.module.state_dict()}
    fake = SimpleNamespace(model=fairscale_like(build(tiny_cfg())[0].module))  # world size 1
    for optimizer_state, layout in (
        ({"shards": [optimizer.state_dict()] * 2}, "flat shards of 2 processes"),
        (optimizer.state_dict(), "per parameter"),
    ):
        with pytest.raises(checkpoint.CheckpointError) as error:
            FairScaleEngine._load_file(
                fake, "ckpt.pyth", {**state, "optimizer_state": optimizer_state}, optimizer
            )
        message = str(error.value)
        assert "ckpt.pyth" in message and layout in message
        assert "FSDP.BACKEND fairscale on 1 processes" in message and "TRAIN.WEIGHTS" in message
    state["optimizer_state"] = {"shards": [optimizer.state_dict()]}
    FairScaleEngine._load_file(fake, "ckpt.pyth", state, optimizer)  # its own layout: loads


@pytest.mark.slow
@pytest.mark.exhaustive
def test_skip_corrupt_under_one_rank_only_matches_half_the_gradient(two):
    """Fix 5 (DDP and FSDP2): the all-corrupt process took part with zero gradients; the mean
    over processes is half of rank 0's gradient."""
    for name in ("ddp", "fsdp"):
        got = two[0]["skip_corrupt"][name]
        assert got["returned"] and not two[1]["skip_corrupt"][name]["returned"]
        cfg = tiny_cfg()
        engine, _, scaler, loss_fn, _ = build(cfg)
        engine.module.load_state_dict(got["start"])
        x, y = batches(cfg, 1)[0]
        engine.forward_backward(x[:4], y[:4], loss_fn, scaler)
        for n, p in engine.module.named_parameters():
            torch.testing.assert_close(got["grads"][n], p.grad / 2, atol=1e-7, rtol=1e-5, msg=n)
        assert two[1]["skip_corrupt"][name]["grads"].keys() == got["grads"].keys()


@pytest.mark.slow
@pytest.mark.exhaustive
def test_resume_gives_each_process_its_own_rng(two):
    """Fix 1: both processes draw after the resume what they drew after the save, and the two
    processes' draws differ (per-rank seeding survives)."""
    for r in (0, 1):
        assert torch.equal(two[r]["rng"]["after_load"], two[r]["rng"]["after_save"]), r
    assert not torch.equal(two[0]["rng"]["after_save"], two[1]["rng"]["after_save"])


@pytest.mark.slow
@pytest.mark.exhaustive
def test_fsdp2_ema_evaluates_without_resharding_after_forward(two):
    """Fix 2: the EMA swap works after an eval forward that left the parameters gathered; the
    averaged model's output is that of the averaged weights, and the raw weights come back."""
    got = two[0]["fsdp_ema"]
    ref = build(tiny_cfg())[0].module.eval()
    ref.load_state_dict({**got["weights_before"], **got["ema"]})
    with torch.no_grad():
        want = ref(got["x"])
    torch.testing.assert_close(got["averaged"], want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got["averaged"], got["raw"])
    for k, v in got["weights_before"].items():
        assert torch.equal(got["weights_after"][k], v), k


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", list(META_INIT))
def test_sharded_and_staged_models_start_bitwise_from_the_one_process_model(two, variant):
    """Item 8: built on the meta device except on rank 0, then materialised shard by shard
    (FSDP2) or stage by stage (pipeline), the model is bitwise the one-process initial model, or
    the TRAIN.WEIGHTS file or sharded folder: buffers, AMP casts and frozen parameters too."""
    overrides, source = META_INIT[variant]
    got = two[0]["meta_init"][variant]
    if source:
        want, trainable = two[0]["meta_init"][source], None
    else:
        ref = build(tiny_cfg(*overrides[2:]))[0].module  # the same features on one process
        want = ref.state_dict()
        trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert set(got["weights"]) == set(want)
    for k, v in want.items():
        assert got["weights"][k].dtype == v.dtype and torch.equal(got["weights"][k], v), k
    if trainable is not None:
        for r in (0, 1):
            mine = two[r]["meta_init"][variant]
            assert mine["trainable"] == trainable & mine["params"], r
    # the non-persistent buffer of the last block reached the processes holding that block
    extra = [two[r]["meta_init"][variant]["extra"] for r in (0, 1)]
    assert [len(e) for e in extra] == ([1, 1] if "fsdp" in overrides else [0, 1])
    for e in extra:
        for b in e.values():
            assert torch.equal(b, (torch.arange(5.0) + 0.5).to(b.dtype))
    # the drop-path rates (non-persistent float32 buffers) as the one-process model has them,
    # under AMP O2 too, in the processes holding their blocks
    rates = {}
    for r in (0, 1):
        rates.update(two[r]["meta_init"][variant]["rates"])
    one = build(tiny_cfg(*overrides[2:]))[0].module
    want_rates = {n: (b.dtype, b.item()) for n, b in one.named_buffers()
                  if n.endswith("drop_path.keep_prob")}  # fmt: skip
    assert rates == want_rates
    if "VIT.DROP_PATH" in overrides:
        assert len({keep for _, keep in rates.values()}) == len(rates) == 4
        assert {dtype for dtype, _ in rates.values()} == {torch.float32}


@pytest.mark.slow
@pytest.mark.exhaustive
def test_only_rank0_builds_the_whole_model(two):
    """Item 8: under FSDP2 and the pipeline, rank 1 builds the model on the meta device and
    allocates no tensor larger than the largest it keeps (under FSDP2, a padded shard); under
    the pipeline, hardly more than its own stage in all."""
    for variant, (overrides, _) in META_INIT.items():
        got = two[1]["meta_init"][variant]
        assert got["built_on"] == ["meta"], variant
        assert max(got["allocated"]) <= max(got["held"]), variant
        if "pipeline" in overrides:
            assert sum(got["allocated"]) <= sum(got["held"]) + max(got["held"]), variant


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_bfloat16_residual_stream_under_every_engine(two):
    """AMP.RESIDUAL_DTYPE bfloat16 at O1: every block of every engine receives a bfloat16 stream,
    the weights stay float32, the losses stay within 2e-3 of the float32 stream's (measured:
    1.0e-3 at most, on the third step). Without the key O1's stream is float32, except under
    FSDP2 (fsdp, and tensor with its data-parallel FSDP2), whose mixed precision casts every
    block's input to bfloat16: the key changes nothing there."""
    got = two[0]["residual_dtype"]
    for name in RESIDUAL_ENGINES:
        f32, bf16 = got[name, "float32"], got[name, "bfloat16"]
        assert bf16["inputs"] == {torch.bfloat16}, name
        fsdp2 = name in ("fsdp", "tensor")
        assert f32["inputs"] == {torch.bfloat16 if fsdp2 else torch.float32}, name
        assert f32["params"] == bf16["params"] == {torch.float32}, name
        assert all(math.isfinite(x) for x in bf16["losses"]), name
        torch.testing.assert_close(
            torch.tensor(bf16["losses"]), torch.tensor(f32["losses"]), rtol=2e-3, atol=0
        )


@pytest.mark.slow
@pytest.mark.exhaustive
def test_lrfind_stops_in_every_process_together(two):
    """Fix 4: rank 1 wants to stop after one iteration, rank 0 never; both record one."""
    assert two[0]["lrfind"] == two[1]["lrfind"] == 1


@pytest.mark.slow
@pytest.mark.exhaustive
def test_ddp_and_fsdp_reduce_half_gradients_in_fp32(two):
    """Fix 10: one policy (AMP.REDUCE_DTYPE float32): DDP's buckets of bf16 gradients are
    all-reduced in fp32 (the gradients stay bf16), and FSDP2 reduces in fp32 at O3 too."""
    got = two[0]["reduce_dtype"]
    assert got["ddp"] == {torch.float32} and torch.bfloat16 in got["grads"]
    assert got["fsdp"] == torch.float32


# ------------------------------------------------------------------------------------------------ #
# One process
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.slow
@pytest.mark.exhaustive
def test_timm_optimizers_fsdp2_refuses_are_those_that_fail_or_stray_under_it(two, single_thread):
    """Every name of timm's registry stepped twice under FSDP2 on 2 processes: the names
    TIMM_NOT_UNDER_FSDP refuses are exactly those that fail there (in both processes alike) or
    move more than TIMM_FSDP_SHARE of the weights off one process's step (timm's Muon:
    orthogonalised shards). Caught: a name added to the refusals that runs (laprop), one taken
    out that does not (muon, clion)."""
    measured = {}
    for name, got in two[0]["timm_fsdp"].items():
        if isinstance(got, str):
            assert two[1]["timm_fsdp"][name] == got, name  # failed alike: no process waits
            measured[name] = got
            continue
        ref = timm_step(name)
        off = sum(int(((got[k] - ref[k]).abs() > TIMM_FSDP_ATOL).sum()) for k in ref)
        share = off / sum(t.numel() for t in ref.values())
        if share > TIMM_FSDP_SHARE:
            measured[name] = f"{share:.0%} of the weights off"
    expected = set(TIMM_NOT_UNDER_FSDP) - set(EMPTY_SHARD_FAILURES)
    assert set(measured) == expected, {n: measured.get(n) for n in set(measured) ^ expected}


def test_timm_optimizers_that_fail_on_empty_shards():
    """FSDP2 gives the second process an empty shard of a one-row parameter (the class token):
    AdamP's and SGDP's step fails on it (on a shard, a max() of no elements; on a plain empty
    tensor, a reshape), there alone."""
    for name in EMPTY_SHARD_FAILURES:
        assert name in TIMM_NOT_UNDER_FSDP
        empty = torch.nn.Parameter(torch.zeros(0, 4))
        empty.grad = torch.zeros(0, 4)
        optimizer = create_optimizer_v2([empty], opt=name, lr=0.1)
        with pytest.raises(RuntimeError, match=r"numel\(\) == 0|tensor of 0 elements"):
            optimizer.step()


def test_lamb_under_fairscale_is_rejected_naming_both_keys():
    """Fix 3: FairScale's flat shards would give LAMB one trust ratio per shard."""
    with pytest.raises(ConfigError, match=r"OPTIM\.OPTIMIZER.*FSDP\.BACKEND fairscale"):
        tiny_cfg("TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale", "OPTIM.OPTIMIZER", "lamb")


def test_docs_engine_table_is_the_rule():
    with open(os.path.join(ROOT, "docs", "distributed.md")) as f:
        assert validation.engine_feature_table() in f.read()


def _import_time_nodes(node):
    """The statements run when the module is imported (function bodies are not, nor a package
    face's list under ``if TYPE_CHECKING:``, whose names load on first use)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield other
                yield from _import_time_nodes(other)
        elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from _import_time_nodes(child)


def _imports(path, module):
    """Modules of pycls that importing ``module`` (at ``path``) imports."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in _import_time_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("pycls")}


def test_every_module_imports_and_no_import_cycle():
    """Every pycls module imports, and the graph of what importing each pycls module imports
    (function bodies, run later, aside) has no cycle."""
    import importlib

    modules = {}
    for info in pkgutil.walk_packages(pycls.__path__, "pycls."):
        importlib.import_module(info.name)
        spec = importlib.util.find_spec(info.name)
        modules[info.name] = spec.origin
    graph = {m: _imports(p, m) & set(modules) - {m} for m, p in modules.items()}
    # a package's __init__ reached through its submodules is not an edge of interest
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in graph[m]:
            if m.startswith(n + "."):
                continue
            if state.get(n) == "open":
                raise AssertionError(f"import cycle: {' -> '.join([*path, m, n])}")
            if n not in state:
                visit(n, [*path, m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_sampler_seeds_do_not_shift_with_the_epoch():
    """Fix 9: seed s at epoch e + 1 is not seed s + 1 at epoch e."""
    from pycls.datasets.loading.loader import SeededSampler

    def order(seed, epoch):
        s = SeededSampler(50, shuffle=True, seed=seed, image_size=8)
        s.set_epoch(epoch)
        return [k[0] for k in s]

    assert order(0, 1) != order(1, 0)
    assert order(3, 2) == order(3, 2)


def test_sampler_fast_forwards_a_resumed_epoch():
    from pycls.datasets.loading.loader import SeededSampler

    s = SeededSampler(50, shuffle=True, seed=0, image_size=8, rank=1, world_size=2)
    s.set_epoch(4)
    full = list(s)
    s.set_epoch(4, skip=10)
    assert list(s) == full[10:] and len(s) == len(full)


def test_mid_epoch_resume_does_not_load_trained_batches_again(tmp_path, single_thread):
    """Fix 7: a run stopped after k steps of an epoch resumes by loading only the rest of it
    (and ends with the weights of the uninterrupted run)."""
    from pycls.core.trainer import Trainer, seed_everything

    args = ["DEVICE", "cpu", "OPTIM.MAX_EPOCH", "1", "DATA_LOADER.NUM_WORKERS", "0",
            "LOG_PERIOD", "3"]  # fmt: skip
    seed_everything(0)
    straight = Trainer(tiny_quickstart(tmp_path / "a", *args), torch.device("cpu"))
    straight.resume_or_init()
    straight.train_epoch(0)
    seed_everything(0)
    stopped = Trainer(tiny_quickstart(tmp_path / "b", *args), torch.device("cpu"))
    stopped.resume_or_init()
    n_steps = len(stopped.train_loader)
    loads = []  # the keys the training set is asked for
    dataset = stopped.train_dataset
    get = type(dataset).__getitem__
    type(dataset).__getitem__ = lambda self, key: loads.append(key) or get(self, key)
    try:
        stopped.preemption = _Signalled()  # stops (and checkpoints) after LOG_PERIOD = 3 steps
        with pytest.raises(distributed.Preempted):
            stopped.train_epoch(0)
        resumed = Trainer(tiny_quickstart(tmp_path / "b", *args), torch.device("cpu"))
        resumed.resume_or_init()
        assert resumed.start_iter == 3
        loads.clear()
        resumed.train_epoch(0)
    finally:
        type(dataset).__getitem__ = get
    batch = resumed.train_loader.batch_size
    assert len(loads) == (n_steps - 3) * batch
    a, b = straight.engine.module.state_dict(), resumed.engine.module.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class _Signalled:
    requested, interrupted = True, False  # a preemption signal, not Ctrl-C


def test_lr_scale_batch_follows_the_curriculum_batch(tmp_path, single_thread):
    """Fix 11: OPTIM.LR_SCALE_BATCH scales the rate with the batch of the epoch, which the
    curriculum grows."""
    from pycls.core.trainer import Trainer

    cfg = tiny_quickstart(
        tmp_path, "DEVICE", "cpu", "OPTIM.LR_SCALE_BATCH", "64", "CURRICULUM.ENABLED", "True",
        "CURRICULUM.START_SIZE", "8", "CURRICULUM.STEP", "4", "OPTIM.MAX_EPOCH", "4",
        "CURRICULUM.SCALE_BATCH", "True", "OPTIM.WARMUP_EPOCHS", "0", "OPTIM.LR_POLICY",
        "constant",
    )  # fmt: skip
    trainer = Trainer(cfg, torch.device("cpu"))
    sizes = [trainer.sizes.batch_size(e) for e in range(4)]
    assert len(set(sizes)) > 1, sizes  # the curriculum grows the batch
    for epoch in range(4):
        trainer._apply_image_size(epoch)
        want = cfg.OPTIM.BASE_LR * sizes[epoch] / 64
        assert trainer.schedule(epoch) == pytest.approx(want), epoch
