"""The parallel engines on one CUDA device (a process group of one, NCCL): DDP, FSDP2 (with AMP and
CPU offload), FairScale FSDP (which runs only on CUDA) and a one-stage pipeline, each against the
same model trained without an engine. Skipped without CUDA.
"""

import pytest
import torch

from pycls import config, distributed
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint import single_file as checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY = [
    "AMP.CPU_LEVEL",
    "same",  # the AMP level a test asks for, whatever this CPU's bfloat16 speed
    "MODEL.NUM_CLASSES", "10", "VIT.PATCH_SIZE", "4", "VIT.DEPTH", "4", "VIT.WIDTH", "64",
    "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "128", "VIT.CLASSIFIER", "token",
    "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "TRAIN.BATCH_SIZE", "16",
    "OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "0.003", "OPTIM.WEIGHT_DECAY", "0.05",
    "OPTIM.CLIP_GRAD", "1.0", "DEVICE", "cuda",
]  # fmt: skip
STEPS = 5


def tiny_cfg(*overrides):
    return config.load_cfg(None, [*TINY, *overrides])


@pytest.fixture(autouse=True)
def exact_fp32():
    # TF32 would round the fp32 references differently from run to run
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _group(cpu_collectives=False):
    distributed.init_single_process_group("cuda", cpu_collectives=cpu_collectives)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def group():
    """A process group of one on the GPU."""
    yield _group()
    distributed.destroy_process_group()


def train(cfg, device, steps=STEPS):
    """``steps`` trainer steps on fixed batches; returns (engine, optimizer, losses)."""
    from pycls.core import builders
    from pycls.core.trainer import build_training

    torch.manual_seed(0)
    engine, optimizer, scaler, loss_fn, _ = build_training(cfg, device)
    step = builders.build_training_step(cfg, engine, optimizer, scaler, loss_fn)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        images = torch.randn(16, 3, 16, 16, generator=g).to(device)
        labels = torch.randint(0, 10, (16,), generator=g).to(device)
        [((loss, logits), _)] = step(iter([(images, labels, 0)]), cfg.OPTIM.BASE_LR)
        assert logits.shape == (16, 10)
        losses.append(float(loss))
    return engine, optimizer, losses


def reference(device, *overrides):
    engine, _, losses = train(tiny_cfg(*overrides), device)
    return {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}, losses


def assert_close_to(engine, ref, losses, atol=2e-5, rtol=1e-5):
    weights, ref_losses = ref
    got = engine.full_state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    assert set(got) == set(weights)
    for k, v in weights.items():
        torch.testing.assert_close(got[k].detach().float().cpu(), v, atol=atol, rtol=0, msg=k)


@pytest.mark.parametrize(
    "overrides",
    [
        ["TRAIN.PARALLEL", "ddp"],
        ["TRAIN.PARALLEL", "ddp", "DDP.GRADIENT_AS_BUCKET_VIEW", "True",
         "DDP.STATIC_GRAPH", "True"],
        ["TRAIN.PARALLEL", "fsdp"],
        ["TRAIN.PARALLEL", "fsdp", "FSDP.RESHARD_AFTER_FORWARD", "False"],
        ["TRAIN.PARALLEL", "pipeline", "PIPELINE.STAGES", "1", "PIPELINE.MICRO_BATCHES", "2"],
        ["TRAIN.PARALLEL", "pipeline", "PIPELINE.STAGES", "1", "PIPELINE.STAGES_PER_RANK", "2",
         "PIPELINE.SCHEDULE", "interleaved_1f1b"],
        ["TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale"],
    ],
)  # fmt: skip
def test_engine_on_one_gpu_matches_no_engine(group, overrides):
    ref = reference(group)
    engine, _, losses = train(tiny_cfg(*overrides), group)
    assert_close_to(engine, ref, losses)


def test_fsdp2_bf16_o2_keeps_fp32_shards(group):
    from torch.distributed.tensor import DTensor

    engine, optimizer, losses = train(tiny_cfg("TRAIN.PARALLEL", "fsdp", "AMP.LEVEL", "O2"), group)
    params = list(engine.module.parameters())
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
    assert not any("master" in s for s in optimizer.state.values())
    _, ref_losses = reference(group, "AMP.LEVEL", "O2")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def test_fsdp2_float16_scaling_and_cpu_offload():
    device = _group(cpu_collectives=True)
    try:
        cfg = tiny_cfg(
            "TRAIN.PARALLEL", "fsdp", "FSDP.CPU_OFFLOAD", "True", "AMP.LEVEL", "O1",
            "AMP.DTYPE", "float16",
        )  # fmt: skip
        engine, optimizer, losses = train(cfg, device)
        assert all(p.to_local().device.type == "cpu" for p in engine.module.parameters())
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        distributed.destroy_process_group()


def test_fairscale_weight_decay_groups_and_fp32_norms(group):
    """FairScale flattens parameters: decay and no-decay ones must stay in separate flat
    parameters (same element counts as the unwrapped groups), and LayerNorms stay fp32 at O1."""
    from pycls.core import builders
    from pycls.optim import param_groups

    cfg = tiny_cfg("TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale", "AMP.LEVEL", "O1")
    plain = {g["name"]: sum(p.numel() for p in g["params"])
             for g in param_groups(builders.build_model(cfg), 0.05)}  # fmt: skip
    engine, optimizer, losses = train(cfg, group)
    got = {g["name"]: sum(p.numel() for p in g["params"]) for g in optimizer.param_groups}
    assert got == plain
    norms = [m for m in engine.module.modules() if type(m).__name__ == "FullyShardedDataParallel"
             and not m.mixed_precision]  # fmt: skip
    assert len(norms) == 2 * cfg.VIT.DEPTH + 1
    assert all(torch.isfinite(torch.tensor(losses)))


def test_fairscale_checkpoint_resumes(group, tmp_path):
    cfg = tiny_cfg("TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale")
    engine, optimizer, _ = train(cfg, group, steps=2)
    path = engine.save(str(tmp_path), 1, optimizer=optimizer, cfg_yaml=cfg.dump())
    want = engine.full_state_dict()
    fresh, fresh_opt, _ = train(cfg, group, steps=1)
    fresh.load(path, sharded_checkpoint.read_state(path), optimizer=fresh_opt)
    got = fresh.full_state_dict()
    for k in want:
        assert torch.equal(got[k].cpu(), want[k].cpu()), k
    # the single file also serves a plain model (TEST.WEIGHTS)
    from pycls.core import builders

    plain = builders.build_model(tiny_cfg())
    checkpoint.load_model_weights(path, plain)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, want[k].cpu()), k


def test_fsdp2_sharded_checkpoint_resumes(group, tmp_path):
    cfg = tiny_cfg("TRAIN.PARALLEL", "fsdp")
    engine, optimizer, _ = train(cfg, group, steps=2)
    path = engine.save(str(tmp_path), 1, optimizer=optimizer, cfg_yaml=cfg.dump())
    want = engine.full_state_dict()
    fresh, fresh_opt, _ = train(cfg, group, steps=1)
    fresh.load(path, sharded_checkpoint.read_state(path), optimizer=fresh_opt)
    got = fresh.full_state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
