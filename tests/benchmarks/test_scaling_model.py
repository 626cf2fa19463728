"""benchmarks/scaling_model.py: its arithmetic on cases worked out by hand, its fitted jitter, and
the whole script in a few seconds."""

import json
import math
import time

import pytest

from pycls.engines.mesh_traffic import Unit
from tests.helpers import load_tool

model = load_tool("scaling_model", folder="benchmarks")

# 2 machines of 8 GPUs, 50 GB/s wherever a ring runs, no latency, no stragglers
FLAT = model.Cluster(gpus_per_node=8, nvlink=100e9, node_network=100e9, efficiency=0.5,
                     latency_node=0.0, latency_network=0.0)  # fmt: skip


def _workload(units, compute_s, optimizer_s=0.0, grad_bytes=0):
    return model.Workload("toy", tuple(units), 1, compute_s + optimizer_s, optimizer_s, grad_bytes)


@pytest.mark.parametrize("compute_ms, want_ms", [(30.0, 30.0 + 0.98304), (1.5, 1.5 + 1.46608)])
def test_ddp_buckets_overlap_the_backward_as_they_become_ready(compute_ms, want_ms):
    """Two 25 MiB buckets on 16 GPUs: each all-reduce sends 2 x 25 MiB x 15/16 = 49.152 MB per
    process, 0.98304 ms at 50 GB/s. The first is ready halfway through the backward (2/3 of
    the compute), the second at its end: with a 20 ms backward both hide but the last; with a
    1 ms one the second waits for the first, ending at 0.5 + 2 x 0.98304 ms, 1.46608 ms after
    the backward began. Checked to fail with the buckets all-reduced after the backward."""
    w = _workload([], compute_ms / 1e3, grad_bytes=2 * model.DDP_BUCKET)
    assert model.ddp_step(w, 16, FLAT) * 1e3 == pytest.approx(want_ms, rel=1e-9)


def test_fsdp_prefetches_its_gathers_and_hsdp_keeps_them_on_nvlink():
    """Two blocks of one 1600 x 1000 weight and a 16 x 1000 root, 16 GPUs. FSDP2 over all 16 at
    50 GB/s: a block's bfloat16 gather sends 3.2 MB x 15/16 = 3 MB (60 us), its fp32
    reduce-scatter 120 us, the root's 0.6 and 1.2 us. Without compute, forward: the root's
    gather and both blocks' (120.6 us); backward: the last block's gather (60), the first
    block's gather with the last's reduce-scatter (180), the first block's and the root's
    reduce-scatters (121.2): 481.8 us in all. With 3 ms of compute (a block's forward 0.5 ms,
    its backward 1 ms) the second gather and the first block's gather with the second's
    reduce-scatter hide behind a block: 0.6 + 60 + 500 + 500 forward, 60 + 1000 + 1000 + 121.2
    backward, 3241.8 us. HSDP (2 replicas of 8): gathers and reduce-scatters of 8 processes on
    NVLink; the replicas' all-reduce of each eighth, one process per machine: a block's sends
    2 x 0.8 MB x 1/2 = 0.8 MB over an eighth of a machine's 100 GB/s at 0.5 (6.25 GB/s).
    Checked to fail with the gathers counted after their blocks instead of behind them."""
    block = Unit(((1600, 1000),), ((1600, 1000),), 2)
    root = Unit(((16, 1000),), ((16, 1000),), 2)
    w = _workload([block, block, root], 0.0)
    assert model.fsdp_step(w, 16, FLAT) * 1e6 == pytest.approx(481.8, rel=1e-9)
    busy = _workload([block, block, root], 3e-3)
    assert model.fsdp_step(busy, 16, FLAT) * 1e6 == pytest.approx(3241.8, rel=1e-9)
    g, s = 3.2e6 * 7 / 8 / 50e9, 6.4e6 * 7 / 8 / 50e9  # within a machine: NVLink, 50 GB/s
    rg, rs = 32e3 * 7 / 8 / 50e9, 64e3 * 7 / 8 / 50e9
    across, root_across = 0.8e6 / 6.25e9, 8e3 / 6.25e9  # 100 GB/s x 1/8 x 0.5
    want = rg + g + g  # forward
    want += g + max(0.0, g + s, across) + s + across + rs + root_across  # backward
    assert model.fsdp_step(w, 16, FLAT, replicate=2) == pytest.approx(want, rel=1e-9)


def replace_cluster(**fields):
    from dataclasses import replace

    return replace(FLAT, **fields)


def test_stragglers_and_one_gpu():
    """One GPU is its own step; n GPUs wait 1 + jitter sqrt(2 ln n) of it for the slowest."""
    w = _workload([], 0.1)
    cluster = replace_cluster(jitter=0.02)
    assert model.step_seconds(w, "ddp", 1, cluster) == 0.1
    assert model.straggler(cluster, 64) == pytest.approx(1 + 0.02 * math.sqrt(2 * math.log(64)))


def test_the_jitter_is_the_one_fitted_to_the_published_run():
    """JITTER, the one number fitted to a published figure, is what fit_jitter finds (to 1 %),
    and with it the calibrated model gives that run's 128-GPU throughput."""
    from dataclasses import replace

    base = replace(model.NETWORKS["infiniband"], jitter=0.0)
    assert model.fit_jitter(base) == pytest.approx(model.JITTER, rel=1e-2)
    name, check = next(iter(model.CHECKS.items()))
    rows = [r for r in model.check(model.NETWORKS["infiniband"]) if r["check"] == name]
    assert {r["gpus"]: round(r["predicted"]) for r in rows} == pytest.approx(
        check["published"], rel=2e-3
    )


def test_the_script_writes_its_table_plot_and_rows_in_seconds(tmp_path):
    """The three ViTs on both networks with the published comparison: every row has a
    throughput and an efficiency, ViT-B/16 on one H200 is BENCHMARKS.md's 3026 images/s, and
    it takes a few CPU seconds (the models are built on the meta device)."""
    start = time.process_time()
    out = model.main(["--check", "--plot", str(tmp_path / "p.png"), "--json",
                      str(tmp_path / "rows.json")])  # fmt: skip
    assert time.process_time() - start < 30
    assert (tmp_path / "p.png").stat().st_size > 10_000
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == 2 * 3 * len(model.ENGINES) * len(model.GPUS) == len(out["rows"])
    b16 = model.vit_workload("vit_b16")
    assert b16.batch / b16.step_s == pytest.approx(3026, rel=1e-3)
    assert all(0 < r["efficiency"] < 1.1 for r in rows)
