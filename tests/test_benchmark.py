"""--mode time and benchmarks/vs_libraries.py on tiny models on the CPU: fields present, no
thresholds."""

import json

import pytest
import torch
from helpers import QUICKSTART, load_tool

from pycls.core import benchmark, cli
from pycls.core.logging import load_json_stats

TINY = ["VIT.DEPTH", "1", "VIT.WIDTH", "16", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "32"]
TIME_FIELDS = (
    "test_fw_time",
    "train_fw_bw_time",
    "train_step_time",
    "optim_step_time",
    "train_images_per_sec",
    "test_images_per_sec",
    "loader_images_per_sec",
    "gflops_per_image",
    "test_tflops",
    "train_tflops",
)
CUDA_ONLY_FIELDS = ("peak_tflops", "peak_mem_mb")


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py


@pytest.mark.parametrize(
    "opts",
    [
        ["AMP.LEVEL", "O0"],
        ["AMP.LEVEL", "O2", "AMP.CPU_LEVEL", "same", "OPTIM.CONTIGUOUS_PARAMS", "True"],
    ],
    ids=["O0", "O2_contiguous"],
)
def test_time_mode_logs_iter_times(tmp_path, opts):
    argv = ["--mode", "time", "--cfg", QUICKSTART, "OUT_DIR", str(tmp_path), "DEVICE", "cpu"]
    argv += ["TRAIN.BATCH_SIZE", "8", "PREC_TIME.WARMUP_ITER", "1", "PREC_TIME.NUM_ITER", "2"]
    argv += ["TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic"]
    assert cli.main(argv + TINY + opts) == 0
    log = (tmp_path / "stdout.log").read_text()
    for phase in ("forward", "forward + backward", "train step", "optimizer step"):
        assert f"timing {phase}: 1 warm-up + 2 timed iterations ..." in log, phase
        assert f"{phase}: " in log and " ms per iteration" in log
    stats = [s for s in load_json_stats(tmp_path / "stdout.log") if s["_type"] == "iter_times"]
    assert len(stats) == 1
    s = stats[0]
    for key in TIME_FIELDS:
        assert isinstance(s[key], (int, float)) and s[key] > 0, key
    assert s["train_tflops"] == pytest.approx(
        3 * s["gflops_per_image"] * 1e9 * 8 / s["train_step_time"] / 1e12, rel=1e-3
    )
    for key in CUDA_ONLY_FIELDS:  # present, and null on the CPU
        assert key in s and s[key] is None, key
    # MFU on the CPU: against the matmul peak measured in the compute dtype of the run
    assert s["matmul_tflops"] > 0 and s["mfu_basis"] == "measured matmul"
    assert (
        s["mfu"]
        == s["mfu_vs_matmul"]
        == pytest.approx(s["train_tflops"] / s["matmul_tflops"], rel=1e-4)
    )
    assert f"of the measured {s['matmul_tflops']:.2f} TFLOP/s matmul" in log
    assert s["device"] == "cpu" and s["batch_size"] == 8 and s["skipped_steps"] == 0


def test_time_mode_without_the_data_set_still_times_the_model(tmp_path):
    """The model runs on synthetic batches: a missing image folder only costs the loader's
    number (null), not the run."""
    argv = ["--mode", "time", "--cfg", QUICKSTART, "OUT_DIR", str(tmp_path), "DEVICE", "cpu"]
    argv += ["TRAIN.BATCH_SIZE", "8", "PREC_TIME.WARMUP_ITER", "1", "PREC_TIME.NUM_ITER", "2"]
    argv += ["TRAIN.DATASET", "imagefolder", "DATA.PATH", str(tmp_path / "no_such_data")]
    assert cli.main(argv + TINY) == 0
    (s,) = [s for s in load_json_stats(tmp_path / "stdout.log") if s["_type"] == "iter_times"]
    assert s["loader_images_per_sec"] is None and s["train_step_time"] > 0


def test_peak_table_matches_device_names():
    peak = benchmark.peak_tflops_for
    assert peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert peak("NVIDIA H100 PCIe", "bfloat16") == 756.5
    assert peak("NVIDIA H200", "tf32") == 494.7
    assert peak("NVIDIA A100-SXM4-80GB", "float16") == 312.0
    assert peak("Tesla V100-SXM2-32GB", "bfloat16") is None
    assert peak("NVIDIA GeForce RTX 4090", "bfloat16") is None
    assert benchmark.peak_tflops(torch.device("cpu"), "bfloat16") is None


def test_cpu_matmul_peak_is_measured_in_the_dtype_asked_for(monkeypatch):
    fp32 = benchmark.measured_matmul_tflops(torch.device("cpu"), torch.float32, n=256, iters=2)
    bf16 = benchmark.measured_matmul_tflops(torch.device("cpu"), torch.bfloat16, n=256, iters=2)
    assert fp32 > 0 and bf16 > 0
    # 2 n^3 FLOPs over the fastest product (a busy machine only slows products down)
    monkeypatch.setattr(benchmark, "time_calls", lambda fn, device, warmup, iters: [1.0, 0.5])
    peak = benchmark.measured_matmul_tflops(torch.device("cpu"), torch.float32, n=1000)
    assert peak == pytest.approx(2 * 1000**3 / 0.5 / 1e12)


def test_benchmark_tool_tiny(tmp_path):
    tool = load_tool("vs_libraries", "pycls_benchmark_tool", "benchmarks")
    argv = ["--tiny", "--batch-size", "4", "--iters", "1", "--warmup", "1", "--skip-compile"]
    rows = tool.main(argv + ["--device", "cpu", "--out", str(tmp_path)])
    for name in ("benchmark.md", "benchmark.json", "benchmark.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    assert [r["table"] for r in rows] == ["libraries"] * 4 + ["best"] * 4 + ["ablation"] * 7
    # every row of the best-settings table is compiled
    assert all(r["note"] == "skipped (--skip-compile)" for r in rows if r["table"] == "best")
    allowed_notes = {"timm not installed", "skipped (--skip-compile)"}
    for r in rows:
        if "note" in r:
            assert r["note"] in allowed_notes, r
            continue
        for key in ("images_per_sec", "relative", "tflops", "step_ms", "batch_size"):
            assert r[key] > 0, (r["name"], key)
        assert r["mfu"] is None and r["peak_mem_gb"] is None  # CPU: no datasheet peak
    measured = {r["name"] for r in rows if "note" not in r}
    assert len(measured) >= 9  # everything but compile (skipped) and, without timm, timm
    assert rows[8]["relative"] == 1.0 and rows[0]["relative"] == 1.0
    assert rows[-1]["batch_size"] == 8  # the larger-batch row doubles the batch
    try:
        import timm  # noqa: F401
    except ImportError:
        assert rows[1]["note"] == "timm not installed"

    table = (tmp_path / "benchmark.md").read_text()
    for r in rows:
        assert r["name"] in table
    saved = json.loads((tmp_path / "benchmark.json").read_text())
    assert [r["name"] for r in saved["rows"]] == [r["name"] for r in rows]
    assert saved["header"]["command"].startswith("python benchmarks/vs_libraries.py --tiny")


def test_benchmark_tool_measures_only_the_tables_asked_for(tmp_path):
    tool = load_tool("vs_libraries", "pycls_benchmark_tool", "benchmarks")
    argv = ["--tiny", "--batch-size", "4", "--iters", "1", "--warmup", "1", "--device", "cpu"]
    rows = tool.main(argv + ["--tables", "libraries", "--out", str(tmp_path)])
    assert [r["table"] for r in rows] == ["libraries"] * 4
    table = (tmp_path / "benchmark.md").read_text()
    assert "Libraries (relative" in table and "Ablation" not in table and "best" not in table


def test_timings_are_the_median_and_quartiles_of_the_timed_iterations(monkeypatch):
    """The median is robust to one slow iteration (a busy machine), the IQR shows the spread."""
    clock = iter([0.0, 1.0, 1.0, 1.5, 1.5, 11.5, 11.5, 12.7, 12.7, 13.8])  # 1, .5, 10, 1.2, 1.1
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: next(clock))
    times = benchmark.time_calls(lambda: None, torch.device("cpu"), warmup=0, iters=5)
    assert times == pytest.approx([1.0, 0.5, 10.0, 1.2, 1.1])
    q1, median, q3 = benchmark.quartiles(times)
    assert median == pytest.approx(1.1) and (q1, q3) == pytest.approx((1.0, 1.2))
    assert benchmark.quartiles([0.3]) == (0.3, 0.3, 0.3)


def test_time_mode_reports_the_spread_of_each_phase(tmp_path):
    argv = ["--mode", "time", "--cfg", QUICKSTART, "OUT_DIR", str(tmp_path), "DEVICE", "cpu"]
    argv += ["TRAIN.BATCH_SIZE", "8", "PREC_TIME.WARMUP_ITER", "1", "PREC_TIME.NUM_ITER", "5"]
    argv += ["TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic"]
    assert cli.main(argv + TINY) == 0
    (s,) = [s for s in load_json_stats(tmp_path / "stdout.log") if s["_type"] == "iter_times"]
    for key in ("test_fw_time", "train_fw_bw_time", "train_step_time", "optim_step_time"):
        assert 0 <= s[f"{key}_iqr"] < 10 * s[key], key
    assert "ms per iteration (median; middle half " in (tmp_path / "stdout.log").read_text()


def test_compile_benchmark_tool_tiny(tmp_path):
    """The eager rows only (compiling costs tens of seconds): one process per measurement, the
    table's rows, ratios to pycls eager and first-step column."""
    tool = load_tool("compile_speed", folder="benchmarks")
    only = ["pycls_eager", "timm_eager"] if _has_timm() else ["pycls_eager"]
    tool.main(["--tiny", "--rounds", "1", "--iters", "2", "--warmup", "0", "--only", *only,
               "--out", str(tmp_path)])  # fmt: skip
    table = (tmp_path / "compile.md").read_text()
    assert "| pycls, eager |" in table and "| 1.000x |" in table
    assert ("| timm, eager |" in table) == ("timm_eager" in only)
    results = json.loads((tmp_path / "compile.json").read_text())["results"]
    assert set(results) == set(only)
    assert all(len(r[0]["times"]) == 2 and r[0]["first"] > 0 for r in results.values())


def _has_timm():
    try:
        import timm  # noqa: F401  (optional)
    except ImportError:
        return False
    return True


def test_optimizer_benchmark_tool_tiny(tmp_path):
    """One contender and the reference it is compared with (added by the tool), one process each."""
    tool = load_tool("optimizer_step", folder="benchmarks")
    tool.main(["--tiny", "--threads", "1", "--rounds", "1", "--iters", "1", "--warmup", "0",
               "--only", "pycls_adamw", "--out", str(tmp_path)])  # fmt: skip
    table = (tmp_path / "optimizer.md").read_text()
    assert "| 1 | pycls AdamW |" in table
    assert "| 1 | torch.optim.AdamW(fused=True) |" in table and "| 1.00x fused AdamW |" in table
