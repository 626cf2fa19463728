"""The CNN families under the engines: DDP and FSDP2 in 2 processes against one process, AMP O2
keeping batch norm in fp32.

Batch norm normalises each process's share of the batch with that share's statistics (as
upstream pycls does, without SyncBatchNorm), so the one-process reference is the same global
batch in two accumulated micro-batches of one share each: the same per-share statistics, the
same mean gradient. The weights agree to rounding; the running statistics differ by design
(DDP keeps rank 0's, the reference updates them with both shares) and are not compared.
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from pycls import config, distributed
from pycls.checkpoint import sharded, single_file
from pycls.core import builders, cli
from pycls.core.trainer import Trainer, build_training, train_model
from pycls.engines.ddp import sync_batch_norm
from pycls.engines.precision import Precision
from pycls.errors import ConfigError
from pycls.models import AnyNet
from tests.helpers import ROOT, resume_from
from tests.helpers.distributed import init_gloo, run_steps, spawn

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

QUICKSTART_REGNET = os.path.join(ROOT, "configs", "quickstart_regnet.yaml")
SMALL = ["TRAIN.BATCH_SIZE", "16", "OPTIM.WARMUP_EPOCHS", "0", "DATA_LOADER.NUM_WORKERS", "0"]
STEPS = 3
# The runs of several epochs: the digits 0 and 1 alone, a fifth of the images (so of the time), in
# 5 steps of 64 an epoch
TWO_CLASSES = ["DATA.CLASSES", "[0, 1]", "MODEL.NUM_CLASSES", "2"]
AMP_O2 = ["AMP.LEVEL", "O2", "AMP.DTYPE", "bfloat16"]
ATOL = 2e-5


def cnn_cfg(*overrides):
    return config.load_cfg(QUICKSTART_REGNET, [*SMALL, *overrides])


def cnn_batches(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    size, n = cfg.TRAIN.IM_SIZE, cfg.TRAIN.BATCH_SIZE
    return [
        (torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g))
        for _ in range(STEPS)
    ]


def _params(engine):
    state = engine.full_state_dict()
    names = {n for n, _ in engine.module.named_parameters()}
    return {k: v.detach().float().clone() for k, v in state.items() if k in names}


def _forward_dtypes(seen):
    """A global hook recording the parameter dtype of each batch norm and convolution as its
    forward sees it (FSDP2 gathers and casts the parameters just before)."""

    def record(module, _):
        if isinstance(module, torch.nn.BatchNorm2d):
            seen.add(("norm", module.weight.dtype, module.running_mean.dtype))
        elif isinstance(module, torch.nn.Conv2d):
            seen.add(("conv", module.weight.dtype))

    return torch.nn.modules.module.register_module_forward_pre_hook(record)


def _worker(rank, world, port, out):
    init_gloo(rank, world, port)
    try:
        results = {}
        for name in ("ddp", "fsdp"):
            cfg = cnn_cfg("TRAIN.PARALLEL", name)
            engine, _, losses = run_steps(cfg, cnn_batches(cfg), rank, world)
            results[name] = {"losses": losses, "params": _params(engine)}
        cfg = cnn_cfg("TRAIN.PARALLEL", "fsdp", *AMP_O2)
        seen = set()
        with _forward_dtypes(seen):
            _, _, losses = run_steps(cfg, cnn_batches(cfg), rank, world)
        results["fsdp_o2"] = {"losses": losses, "dtypes": seen}
        if rank == 0:
            torch.save(results, out)
    finally:
        distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The 2-process runs of this file's tests, in one spawn."""
    out = str(tmp_path_factory.mktemp("cnn_engines") / "cnn_engines.pt")
    spawn(_worker, 2, out)
    return torch.load(out, weights_only=False)  # our own file: sets of dtypes


def test_ddp_and_fsdp_match_one_process(two_processes):
    results = two_processes
    cfg = cnn_cfg()
    engine, _, losses = run_steps(cfg, cnn_batches(cfg), accum=2)  # one share per micro-batch
    reference = _params(engine)
    for name in ("ddp", "fsdp"):
        torch.testing.assert_close(results[name]["losses"], losses, rtol=1e-5, atol=0)
        for key, value in reference.items():
            torch.testing.assert_close(results[name]["params"][key], value, rtol=0, atol=ATOL)
    # The shares' statistics matter: the whole batch at once trains differently
    whole, _, whole_losses = run_steps(cfg, cnn_batches(cfg))
    assert whole_losses[1:] != pytest.approx(losses[1:], rel=1e-4)


def test_fsdp_o2_keeps_batch_norm_in_fp32(two_processes):
    # As AMP O2 does in one process: the gathered batch-norm parameters are fp32 in the forward
    # while FSDP2's policy casts the convolutions' to bfloat16
    result = two_processes["fsdp_o2"]
    assert result["dtypes"] == {
        ("norm", torch.float32, torch.float32),
        ("conv", torch.bfloat16),
    }
    # and it trains as one process at O2 does, to bfloat16 rounding
    cfg = cnn_cfg(*AMP_O2)
    _, _, losses = run_steps(cfg, cnn_batches(cfg), accum=2)
    torch.testing.assert_close(result["losses"], losses, rtol=2e-2, atol=0)


def test_o2_keeps_batch_norm_in_fp32():
    model = AnyNet(
        stem_type="res_stem_cifar",
        stem_w=8,
        depths=(1,),
        widths=(16,),
        strides=(2,),
        bot_muls=(1.0,),
        group_ws=(8,),
        se_r=0.25,
        num_classes=10,
    )
    p = Precision("O2", device_type="cpu")
    model = p.prepare_model(model)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            tensors = [module.weight, module.bias, module.running_mean, module.running_var]
            assert {t.dtype for t in tensors} == {torch.float32}, name
        elif isinstance(module, torch.nn.Conv2d | torch.nn.Linear):
            assert module.weight.dtype == torch.bfloat16, name
    with p.autocast():
        out = model(p.cast_input(torch.randn(2, 3, 16, 16)))
    out.float().sum().backward()
    assert model.stem.bn.weight.grad.dtype == torch.float32


def test_sync_batch_norm_option():
    # Conversion keeps every name and value (upstream checkpoints still load); CUDA only
    model = AnyNet(
        stem_type="res_stem_cifar", stem_w=8, depths=(1,), widths=(16,), strides=(2,),
        bot_muls=(1.0,), group_ws=(8,), num_classes=10,
    )  # fmt: skip
    state = {k: v.clone() for k, v in model.state_dict().items()}
    synced = sync_batch_norm(model, torch.device("cuda"))
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in synced.modules())
    assert not any(type(m) is torch.nn.BatchNorm2d for m in synced.modules())
    for key, value in synced.state_dict().items():
        torch.testing.assert_close(value, state[key])
    with pytest.raises(ConfigError, match="BN.SYNC: SyncBatchNorm needs CUDA"):
        sync_batch_norm(model, torch.device("cpu"))
    with pytest.raises(ConfigError, match="BN.SYNC: SyncBatchNorm needs CUDA.*DEVICE is cpu"):
        cnn_cfg("BN.SYNC", "True", "DEVICE", "cpu", "TRAIN.PARALLEL", "ddp")
    with pytest.raises(ConfigError, match=r"BN.SYNC.*TRAIN.PARALLEL fsdp"):
        cnn_cfg("BN.SYNC", "True", "TRAIN.PARALLEL", "fsdp")


def test_channels_last_memory_format(tmp_path):
    cfg = cnn_cfg("MODEL.MEMORY_FORMAT", "channels_last", "OUT_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    assert builders.channels_last(cfg, cpu)
    assert not builders.channels_last(cnn_cfg(), cpu)  # auto: CUDA only
    assert builders.channels_last(cnn_cfg(), torch.device("cuda"))
    assert not builders.channels_last(cnn_cfg("TRAIN.PARALLEL", "fsdp"), torch.device("cuda"))
    torch.manual_seed(0)
    engine = build_training(cfg, cpu)[0]
    conv = engine.module.stem.conv.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    loader = builders.build_loader(cfg, train=False)
    images, _, _ = next(iter(builders.device_batches(cfg, loader, cpu, train=False)))
    assert images.is_contiguous(memory_format=torch.channels_last)
    # The same function: logits of the contiguous model on contiguous input
    torch.manual_seed(0)
    plain = build_training(cnn_cfg("OUT_DIR", str(tmp_path)), cpu)[0].module.eval()
    with torch.no_grad():
        expected = plain(images.contiguous())
        got = engine.module.eval()(images)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"MODEL.MEMORY_FORMAT.*TRAIN.PARALLEL fsdp"):
        cnn_cfg("MODEL.MEMORY_FORMAT", "channels_last", "TRAIN.PARALLEL", "fsdp")


@pytest.mark.slow
def test_cnn_stopped_and_resumed_is_bitwise_the_uninterrupted_run(tmp_path):
    """Checked to fail, on two classes of the digits, with the resume leaving the optimizer's
    momentum out, and with it leaving the EMA out."""
    # Mixup, EMA and precise BN make the run depend on the restored RNG and EMA state too
    opts = ["OPTIM.MAX_EPOCH", "3", "TRAIN.CHECKPOINT_PERIOD", "1", "TRAIN.EMA", "True"]
    opts += ["MIXUP.ALPHA", "0.2", "BN.USE_PRECISE_STATS", "True", "BN.NUM_SAMPLES_PRECISE", "256"]
    opts += TWO_CLASSES
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train_model(config.load_cfg(QUICKSTART_REGNET, [*opts, "OUT_DIR", str(full)]))
    resume_from(full, resumed, epoch=1)
    train_model(config.load_cfg(QUICKSTART_REGNET, [*opts, "OUT_DIR", str(resumed)]))
    a = torch.load(single_file.get_checkpoint_path(str(full), 3), weights_only=True)
    b = torch.load(single_file.get_checkpoint_path(str(resumed), 3), weights_only=True)
    assert a["model_state"].keys() == b["model_state"].keys()
    for key in a["model_state"]:
        assert torch.equal(a["model_state"][key], b["model_state"][key]), key
    assert a["ema_state"]["tensors"].keys() == b["ema_state"]["tensors"].keys()
    for name, value in a["ema_state"]["tensors"].items():
        assert torch.equal(value, b["ema_state"]["tensors"][name]), name


def _two_process_run(*opts):
    """The command line of a 2-epoch CNN run on 2 processes (checkpoints after each epoch): batch
    norm per share, precise BN averaged over both, mixup; OUT_DIR to append."""
    opts = ["OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_PERIOD", "1", "TRAIN.BATCH_SIZE", "64",
            "NUM_PROCS", "2", "BN.USE_PRECISE_STATS", "True", "BN.NUM_SAMPLES_PRECISE", "256",
            "MIXUP.ALPHA", "0.2", *TWO_CLASSES, *opts]  # fmt: skip
    return ["--mode", "train", "--cfg", QUICKSTART_REGNET, *opts, "OUT_DIR"]


def _final(out_dir):
    return load_file(os.path.join(out_dir, "model_final.safetensors"))


def _assert_bitwise(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_cnn_ddp_stop_and_resume_is_bitwise(tmp_path, warm_num_procs):
    """Checked to fail, on two classes of the digits, with the resume leaving the optimizer's
    momentum out."""
    # Stopped after epoch 1 and resumed = never stopped (DDP broadcasting rank 0's statistics)
    run = _two_process_run("TRAIN.PARALLEL", "ddp")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert cli.main([*run, str(full)]) == 0
    resume_from(full, resumed, epoch=1)
    assert cli.main([*run, str(resumed)]) == 0
    _assert_bitwise(_final(full), _final(resumed))


@pytest.mark.slow
def test_cnn_fsdp_stop_and_resume_is_bitwise_and_resumes_under_other_engines(
    tmp_path, warm_num_procs
):
    """Checked to fail, on two classes of the digits, with the resume leaving the optimizer's
    momentum out."""
    # At AMP O2: batch-norm units of their own in fp32 beside bfloat16 blocks. Stopped after
    # epoch 1 and resumed from its sharded folder = never stopped
    amp = [*AMP_O2, "AMP.CPU_LEVEL", "same"]  # the command line runs O2 as O0 on the CPU
    run = _two_process_run("TRAIN.PARALLEL", "fsdp", *amp)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert cli.main([*run, str(full)]) == 0
    resume_from(full, resumed, epoch=1, sharded=True)
    assert cli.main([*run, str(resumed)]) == 0
    _assert_bitwise(_final(full), _final(resumed))
    # The same folder under DDP (its shards gathered on 2 processes; a run with nothing left to
    # train writes what it resumed): the weights and statistics of epoch 1, bitwise
    saved = sharded.read_model_state(single_file.get_checkpoint_path(str(full), 1, sharded=True))
    under_ddp = tmp_path / "ddp"
    resume_from(full, under_ddp, epoch=1, sharded=True)
    # (and no precise BN, which a finished run would compute again)
    ddp = _two_process_run("TRAIN.PARALLEL", "ddp", *amp, "OPTIM.MAX_EPOCH", "1",
                           "BN.USE_PRECISE_STATS", "False")  # fmt: skip
    assert cli.main([*ddp, str(under_ddp)]) == 0
    got = _final(under_ddp)
    assert got.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(got[key], value.to(got[key].dtype)), key  # convolutions in bf16
    # and in one process (no process group): the weights and statistics of epoch 1, bitwise
    # (the convolutions' as O2 casts them in one process) and the step it continues from
    under_none = tmp_path / "none"
    resume_from(full, under_none, epoch=1, sharded=True)
    cfg = config.load_cfg(QUICKSTART_REGNET, [*run[4:-1], "NUM_PROCS", "1", "TRAIN.PARALLEL",
                                              "none", "OUT_DIR", str(under_none)])  # fmt: skip
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.resume_or_init()
    assert trainer.start_epoch == 1
    loaded = trainer.engine.module.state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in loaded.items():
        assert torch.equal(value, saved[key].to(value.dtype)), key
    assert loaded["stem.bn.weight"].dtype == torch.float32
    # O2's fp32 master weights, which FSDP2 does not write, from the saved fp32 weights
    conv = trainer.engine.module.stem.conv.weight
    assert conv.dtype == torch.bfloat16
    assert torch.equal(trainer.optimizer.state[conv]["master"], saved["stem.conv.weight"])
