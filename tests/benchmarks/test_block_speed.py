"""benchmarks/block_speed.py: the ViT's block variants at equal FLOPs, forward + backward in CPU
time, alternating rounds in one process."""

import json

from tests.helpers import load_tool


def test_block_speed_times_every_variant_against_the_sequential_block(tmp_path):
    """A tiny model, one round: every variant's row with its FLOPs, its time and its ratio to the
    sequential block (1 for itself); the parallel block's FLOPs are the sequential block's (the
    comparison is at equal FLOPs), the bias-free layers' a little fewer. Checked to fail with the
    variants built without their overrides (every row the sequential model's parameters)."""
    tool = load_tool("block_speed", folder="benchmarks")
    tool.main(["--tiny", "--rounds", "1", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)])
    table = (tmp_path / "block_speed.md").read_text()
    for name in tool.VARIANTS:
        assert f"| {name} |" in table, name
    assert "| 1.000 | 1.000 (1.000-1.000) |" in table and "load " in table
    data = json.loads((tmp_path / "block_speed.json").read_text())
    cx = {n: data[n]["complexity"] for n in tool.VARIANTS}
    assert len({c["flops"] for c in cx.values()}) == 1
    assert len({c["params"] for c in cx.values()}) == len(cx)
    assert all(len(data[n]["times"]) == 1 and data[n]["times"][0][0] > 0 for n in tool.VARIANTS)
