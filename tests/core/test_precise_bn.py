"""Precise batch-norm statistics (BN.USE_PRECISE_STATS): the mean of the batches' means and
unbiased variances, the same in 1 and 2 processes, and wired into training's evaluation."""

import os

import pytest
import torch

from pycls import distributed as dist
from pycls.core import cli
from pycls.core.precise_bn import num_precise_batches, recompute_bn_stats
from pycls.models import AnyNet
from tests.helpers import ROOT, json_stats_of
from tests.helpers.distributed import spawn

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

QUICKSTART_REGNET = os.path.join(ROOT, "configs", "quickstart_regnet.yaml")


def small_net():
    torch.manual_seed(0)
    return AnyNet(
        stem_type="res_stem_cifar",
        stem_w=8,
        block_type="res_basic_block",
        depths=(1,),
        widths=(8,),
        strides=(2,),
        num_classes=3,
        bn_momentum=0.3,
    )


def batches(n=4, size=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 3, 8, 8, generator=g) * (1 + i) + i for i in range(n)]


def test_stats_are_the_mean_over_batches_of_the_batch_statistics():
    net = small_net().eval()
    data = batches()
    recompute_bn_stats(net, data, len(data))
    # Reference: the stem's BN sees the stem conv's output; per batch mean / unbiased variance
    with torch.no_grad():
        outs = [net.stem.conv(x) for x in data]
    mean = torch.stack([o.mean(dim=(0, 2, 3)) for o in outs]).mean(0)
    var = torch.stack([o.var(dim=(0, 2, 3), unbiased=True) for o in outs]).mean(0)
    torch.testing.assert_close(net.stem.bn.running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net.stem.bn.running_var, var, rtol=1e-5, atol=1e-6)
    assert not net.training and net.stem.bn.momentum == 0.3  # mode and momentum restored


def test_only_the_first_batches_and_at_most_one_pass():
    net, other = small_net(), small_net()
    data = batches()
    assert recompute_bn_stats(net, iter(data), 2) == 2
    recompute_bn_stats(other, data[:2], 10)
    torch.testing.assert_close(net.stem.bn.running_var, other.stem.bn.running_var)
    assert num_precise_batches(8192, 32, 45, 1) == 45  # the digits: one pass
    assert num_precise_batches(8192, 64, 10_000, 2) == 64
    assert num_precise_batches(10, 64, 100, 2) == 1


def _two_process_worker(rank, world, port, out):
    env = dist.ProcessEnv(rank, world, rank, "127.0.0.1", port, "spawn")
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=world + 1, is_master=False)
    dist.init_process_group(env, "cpu", store=store)
    try:
        net = small_net()
        data = batches()[rank::world]  # each process its share
        recompute_bn_stats(net, data, len(data))
        if rank == 0:
            torch.save({k: v for k, v in net.state_dict().items() if "running" in k}, out)
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one(tmp_path):
    torch.set_num_threads(1)
    out = str(tmp_path / "stats.pt")
    spawn(_two_process_worker, 2, out)
    two = torch.load(out, weights_only=True)
    one = small_net()
    data = batches()
    recompute_bn_stats(one, data, len(data))
    for key, value in two.items():
        torch.testing.assert_close(value, one.state_dict()[key], rtol=1e-5, atol=1e-6)


def _bn_stats(path):
    state = torch.load(path, weights_only=True)["model_state"]
    return {k: v for k, v in state.items() if k.endswith("running_var")}


@pytest.mark.slow
def test_training_recomputes_stats_before_evaluation(tmp_path):
    runs = {}
    for precise in ("False", "True"):
        out = tmp_path / precise
        opts = ["OPTIM.MAX_EPOCH", "1", "BN.USE_PRECISE_STATS", precise, "OUT_DIR", str(out)]
        assert cli.main(["--mode", "train", "--cfg", QUICKSTART_REGNET, *opts]) == 0
        runs[precise] = (
            _bn_stats(out / "checkpoints" / "model_epoch_0001.pyth"),
            json_stats_of(out, "test_epoch")[-1]["top1_err"],
        )
    (plain, _), (precise, _) = runs["False"], runs["True"]
    # Same training (the statistics do not enter it), other running statistics at the end
    assert plain.keys() == precise.keys()
    assert any(not torch.allclose(plain[k], precise[k]) for k in plain)
