"""Evaluation counts every test sample exactly once, on any number of processes."""

import pytest
import torch

from pycls.checkpoint import single_file as checkpoint
from pycls.core import cli
from pycls.datasets.loading.loader import SeededSampler
from pycls.models import VisionTransformer
from tests.helpers import QUICKSTART, TINY, json_stats_of


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_unpadded_keys_cover_every_sample_once(world):
    n = 359  # the digits test split: not a multiple of 2, 3, 4 or 7
    seen = []
    for rank in range(world):
        sampler = SeededSampler(
            n, shuffle=False, seed=0, image_size=16, rank=rank, world_size=world
        )
        keys = list(sampler)
        assert len(keys) == len(sampler)  # every rank runs the same number of batches
        seen += [index for index, _, _ in keys[: sampler.num_unpadded()]]
    assert sorted(seen) == list(range(n))


@pytest.mark.slow  # about 20 s on 2 idle cores: two spawned processes
def test_one_and_two_processes_evaluate_one_checkpoint_identically(tmp_path, capsys):
    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=16,
        patch_size=4,
        depth=1,
        width=32,
        num_heads=2,
        mlp_dim=64,
        num_classes=10,
        classifier="pooled",
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = checkpoint.save_checkpoint(str(tmp_path), 1, model=model, optimizer=opt, cfg_yaml="")
    stats = {}
    for procs in ("1", "2"):
        out = tmp_path / procs
        opts = ["TEST.WEIGHTS", path, "OUT_DIR", str(out), "NUM_PROCS", procs, "DEVICE", "cpu"]
        # 3 batches per process, the last one short: 359 = 2 x (64 + 64 + 51) + 1
        opts += ["TEST.BATCH_SIZE", "128"]
        assert cli.main(["--mode", "test", "--cfg", QUICKSTART, *TINY, *opts]) == 0
        (stats[procs],) = json_stats_of(out, "test_epoch")
    one, two = stats["1"], stats["2"]
    assert one["num_samples"] == two["num_samples"] == 359
    assert one["top1_err"] == two["top1_err"] and one["top5_err"] == two["top5_err"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
