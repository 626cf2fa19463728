"""Process groups for the tests: a gloo group of ``world`` processes spawned from the test process,
the tiny pipeline-ready ViT every engine test trains, fixed batches, the trainer's steps run by
hand on this process's shard (so that several processes can be compared with one), and the bytes
each collective sends (``CollectiveBytes``)."""

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from pycls import config, distributed
from tests.helpers import warm

# A ViT of 4 blocks on 16 px images; class token + batch-second layout exercise the first stage's
# extra parameter and the transposed activations between stages
TINY_GLOO = [
    "AMP.CPU_LEVEL",
    "same",  # the AMP level a test asks for, whatever this CPU's bfloat16 speed
    "MODEL.NUM_CLASSES", "10", "VIT.PATCH_SIZE", "4", "VIT.DEPTH", "4", "VIT.WIDTH", "32",
    "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64", "VIT.CLASSIFIER", "token",
    "VIT.LAYOUT", "batch_second", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
    "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8", "OPTIM.OPTIMIZER", "adamw",
    "OPTIM.BASE_LR", "0.003", "OPTIM.WEIGHT_DECAY", "0.05", "OPTIM.CLIP_GRAD", "1.0",
    "DEVICE", "cpu", "PIPELINE.MICRO_BATCHES", "4",
]  # fmt: skip
STEPS = 5

# Float32 on one machine: the engines reorder sums (bucketed all-reduce, reduce-scatter, split
# micro-batches), so results agree to rounding, amplified a little by 5 Adam steps
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-5


def tiny_cfg(*overrides):
    return config.load_cfg(None, [*TINY_GLOO, *overrides])


def batches(cfg, steps=STEPS, seed=0):
    """Fixed global batches of random images and labels."""
    g = torch.Generator().manual_seed(seed)
    size, n = cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE
    return [
        (torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g))
        for _ in range(steps)
    ]


def build(cfg, device=None, seed=0):
    """(engine, optimizer, scaler, loss, precision) as the trainer builds them, from seed's init."""
    from pycls.core.trainer import build_training

    torch.manual_seed(seed + distributed.get_rank())  # ranks differ; engines start from rank 0's
    return build_training(cfg, device or torch.device("cpu"))


def run_steps(cfg, data, rank=0, world=1, accum=1):
    """5 trainer steps of this process's shard of each global batch (in ``accum`` accumulated
    micro-batches, as the trainer's loop does); returns (engine, optimizer, global mean losses)."""
    engine, optimizer, scaler, loss_fn, precision = build(cfg)
    losses = []
    for images, labels in data:
        shard = images.shape[0] // world
        mine = slice(rank * shard, (rank + 1) * shard)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        micro = list(zip(images[mine].chunk(accum), labels[mine].chunk(accum)))
        for i, (x, y) in enumerate(micro):
            loss, logits = engine.forward_backward(
                x, y, loss_fn, scaler, loss_scale=1.0 / accum, sync=i == accum - 1
            )
            assert logits.shape == (x.shape[0], 10)
            total += loss.detach().float() * x.shape[0]  # the global mean, as meters compute it
        engine.step(optimizer, scaler, cfg.OPTIM.CLIP_GRAD)
        distributed.all_reduce_sum([total])
        losses.append(float(total) / (shard * world))
    return engine, optimizer, losses


def init_gloo(rank, world, port):
    """Joins the gloo group that ``spawn`` set up: rank of world, one intra-op thread."""
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=world + 1, is_master=False)
    env = distributed.ProcessEnv(rank, world, rank, "127.0.0.1", port, "spawn")
    distributed.init_process_group(env, "cpu", store=store)


def assert_weights_close(ours, ref, atol=WEIGHT_ATOL):
    assert set(ours) == set(ref)
    for k in ref:
        torch.testing.assert_close(ours[k].float(), ref[k].float(), atol=atol, rtol=0, msg=k)


def spawn(fn, world, *args):
    """fn(rank, world, port, *args) in ``world`` warm processes (tests/helpers/warm.py); the
    rendezvous store lives here, on a port the OS picked (a port merely found free could be taken
    before the processes bind it)."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, world_size=world + 1, is_master=True, wait_for_workers=False
    )
    warm.start_processes(fn, args=(world, store.port, *args), nprocs=world)


# What a process sends in each collective, as ring algorithms move data
# (pycls.engines.mesh_traffic's convention): (argument holding the size, factor of (n - 1) / n).
# c10d's operators (process groups' methods, DDP's reducer, FSDP2) and the functional ones
# (DTensor's redistributions)
_SENT = {
    "allreduce_": (0, 2), "allreduce_coalesced_": (0, 2), "all_reduce": (0, 2),
    "all_reduce_": (0, 2), "all_reduce_coalesced": (0, 2), "all_reduce_coalesced_": (0, 2),
    "_allgather_base_": (0, 1), "allgather_": (0, 1), "allgather_into_tensor_coalesced_": (0, 1),
    "allgather_coalesced_": (0, 1),
    "all_gather_into_tensor": (0, "n"), "all_gather_into_tensor_out": (0, "n"),
    "all_gather_into_tensor_coalesced": (0, "n"),
    "_reduce_scatter_base_": (1, 1), "reduce_scatter_": (1, 1),
    "reduce_scatter_tensor_coalesced_": (1, 1), "alltoall_": (1, 1), "alltoall_base_": (1, 1),
    "reduce_scatter_tensor": (0, 1), "reduce_scatter_tensor_coalesced": (0, 1),
    "all_to_all_single": (0, 1), "scatter_": (1, 1), "gather_": (1, 1),
    "broadcast_": (0, None), "broadcast": (0, None), "send": (0, None),  # None: once, whole
    "recv_": (0, 0), "barrier": (0, 0), "wait_tensor": (0, 0), "_wrap_tensor_autograd": (0, 0),
}  # fmt: skip
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _bytes(value):
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _group(func, args):
    """The process group a collective's arguments name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    names = [a.name for a in func._schema.arguments]
    if "group_name" in names:
        return _resolve_process_group(args[names.index("group_name")])
    return torch.distributed.ProcessGroup.unbox(args[names.index("process_group")])


class CollectiveBytes(TorchDispatchMode):
    """Counts, while active, the bytes this process sends in every collective it runs, by
    process group (its ranks): ``sent[ranks] = bytes``, ``calls[ranks][op] = [count, bytes]``.
    It sees torch's c10d operators (what the process groups' methods, DDP's reducer and FSDP2
    call) and the functional collectives DTensor's redistributions call (it lets DTensor
    dispatch first, as torch's CommDebugMode does, which counts calls, not bytes)."""

    def __init__(self):
        super().__init__()
        self.sent, self.calls = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor dispatches first, then the mode sees its parts
        out = func(*args, **(kwargs or {}))
        if func.namespace in _NAMESPACES:
            self._count(func, args)
        return out

    def _count(self, func, args):
        op = func._opname
        if op not in _SENT:
            raise AssertionError(f"a collective this counter does not know: {func}")
        which, factor = _SENT[op]
        if factor == 0:
            return
        group = _group(func, args)
        n, size = group.size(), _bytes(args[which])
        if factor is None:
            sent = size
        elif factor == "n":  # the size of an input, gathered into n times more
            sent = size * (n - 1)
        else:
            sent = factor * size * (n - 1) / n
        ranks = tuple(torch.distributed.get_process_group_ranks(group))
        key = f"{func.namespace}.{op}"
        self.sent[ranks] = self.sent.get(ranks, 0.0) + sent
        calls = self.calls.setdefault(ranks, {}).setdefault(key, [0, 0.0])
        calls[0] += 1
        calls[1] += sent
