"""Process groups for the tests: a gloo group of ``world`` processes spawned from the test process,
the tiny pipeline-ready ViT every engine test trains, fixed batches, and the trainer's steps run by
hand on this process's shard (so that several processes can be compared with one)."""

import torch

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
