"""The timing module (pycls.core.timing) on fake clocks, devices and contenders, where every
number is known; --mode time and the benchmarks/ scripts on tiny models on the CPU: fields
present, no thresholds."""

import glob
import json
import os
import re
import statistics

import pytest
import torch

from pycls.core import benchmark, cli, compile_stats, timing
from pycls.core.logging import load_json_stats
from tests.helpers import QUICKSTART, ROOT, load_tool

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
    # the steps as training runs them (back to back) beside the per-step synchronised figure
    t = s["train_step_time_back_to_back"]
    assert t > 0 and s["train_images_per_sec_back_to_back"] == pytest.approx(8 / t, rel=1e-3)
    assert s["mfu_back_to_back"] == pytest.approx(
        s["train_tflops_back_to_back"] / s["matmul_tflops"], rel=1e-4
    )
    assert "train step back to back " in log and "steps back to back ..." in log
    # what torch.compile did: nothing here, and nothing to warn about
    assert (s["compile"], s["unique_graphs"], s["frames_failed"], s["eager_blocks"]) == (
        False, 0, 0, None
    )  # fmt: skip
    assert s["num_blocks"] == 1 and s["test_compiled"] is False and s["uncompiled"] is False
    assert "WARNING" not in log


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
    fp32 = timing.matmul_tflops(torch.device("cpu"), torch.float32, n=256, iters=2)
    bf16 = timing.matmul_tflops(torch.device("cpu"), torch.bfloat16, n=256, iters=2)
    assert fp32 > 0 and bf16 > 0
    # 2 n^3 FLOPs over the fastest product on a CPU (a busy machine only slows products down)
    fake = timing.Timing((1.0, 0.5, 0.75))
    monkeypatch.setattr(timing, "time_calls", lambda fn, device, warmup, iters: fake)
    peak = timing.matmul_tflops(torch.device("cpu"), torch.float32, n=1000)
    assert peak == pytest.approx(2 * 1000**3 / 0.5 / 1e12)
    # on a GPU, the median (its products are steady; the first ones may still be warming up)
    peak = timing.matmul_tflops(torch.device("meta"), torch.float32, n=1000)
    assert peak == pytest.approx(2 * 1000**3 / 0.75 / 1e12)


def test_benchmark_tool_tiny(tmp_path):
    """Every row's figures agree with each other and its table line shows them: images/s is the
    batch over the step's time, the relative speed is over its table's first measured row, and
    the markdown prints both. Checked to fail with the relative speed inverted (reference over
    row) and with the table printing another row's images/s; it once checked only that each row's
    name appears."""
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
        if "note" in r:
            assert f"| {r['name']} | — | — | {r['note']} |" in table, r["name"]
            continue
        reference = next(x for x in rows if x["table"] == r["table"] and "note" not in x)
        assert r["images_per_sec"] == pytest.approx(r["batch_size"] / r["step_ms"] * 1e3)
        assert r["relative"] == pytest.approx(r["images_per_sec"] / reference["images_per_sec"])
        shown = (f"| {r['name']} | {r['amp']} | {r['batch_size']} | {r['images_per_sec']:.1f} "
                 f"| {r['relative']:.2f}x | {r['tflops']:.3g} |")  # fmt: skip
        assert shown in table, (r["name"], shown)
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


def test_timings_are_the_median_and_quartiles_of_the_timed_iterations():
    """The median is robust to one slow iteration (a busy machine), the IQR shows the spread."""
    ticks = iter([0.0, 1.0, 1.0, 1.5, 1.5, 11.5, 11.5, 12.7, 12.7, 13.8])  # 1, .5, 10, 1.2, 1.1
    t = timing.time_calls(lambda: None, torch.device("cpu"), 0, 5, clock=lambda: next(ticks))
    assert t.times == pytest.approx([1.0, 0.5, 10.0, 1.2, 1.1])
    assert t.median == pytest.approx(1.1) and (t.q1, t.q3) == pytest.approx((1.0, 1.2))
    assert t.iqr == pytest.approx(0.2) and t.min == 0.5 and t.max == 10.0
    assert timing.quartiles([0.3]) == (0.3, 0.3, 0.3)
    with pytest.raises(ValueError):
        timing.time_calls(lambda: None, iters=0)


class _Recorder:
    """A fake device and clock: every call, device synchronisation and clock reading in order;
    the clock advances by one second per reading."""

    def __init__(self):
        self.events = []

    def call(self):
        self.events.append("call")

    def sync(self, device=None):
        self.events.append(f"sync {device}")

    def clock(self):
        self.events.append("clock")
        return float(sum(e == "clock" for e in self.events))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_timed_callable_is_warmed_up_and_synchronised_as_asked(monkeypatch, device):
    """Warm-up calls untimed and unsynchronised; then each sample of ``group`` back-to-back calls
    between a synchronisation and a clock reading at each end (CUDA only: the host has nothing to
    wait for), its time divided by the group."""
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "synchronize", rec.sync)
    t = timing.time_calls(rec.call, torch.device(device), warmup=2, iters=3, group=4,
                          clock=rec.clock)  # fmt: skip
    sync = ["sync cuda"] if device == "cuda" else []
    sample = [*sync, "clock", "call", "call", "call", "call", *sync, "clock"]
    assert rec.events == ["call", "call", *sample * 3]
    # clock readings 1, 2 / 3, 4 / 5, 6: one second per sample of 4 calls
    assert t.times == (0.25, 0.25, 0.25) and t.calls_per_sample == 4


def test_run_pinned_runs_one_measurement_in_a_fresh_pinned_process(tmp_path):
    """The job goes in as JSON, the last line of output comes back as JSON; the thread count and
    extra variables are in the worker's environment; a failing worker names itself."""
    script = tmp_path / "scripts" / "worker.py"
    script.parent.mkdir()
    script.write_text(
        "import json, os, sys\n"
        "job = json.loads(sys.argv[2])\n"
        "if job.get('fail'): sys.exit('worker broke')\n"
        "print('noise')\n"
        "print(json.dumps({'job': job, 'omp': os.environ['OMP_NUM_THREADS'],\n"
        "                  'mkl': os.environ['MKL_NUM_THREADS'], 'x': os.environ['X'],\n"
        "                  'cwd': os.getcwd()}))\n"
    )
    out = timing.run_pinned(str(script), {"n": 1}, threads=3, extra_env={"X": "y"})
    assert out == {"job": {"n": 1}, "omp": "3", "mkl": "3", "x": "y", "cwd": str(tmp_path)}
    with pytest.raises(RuntimeError, match="worker.py worker .* failed .*\n.*worker broke"):
        timing.run_pinned(str(script), {"fail": True}, threads=1, extra_env={"X": "y"})


def test_contenders_take_turns_and_the_ratios_are_right(monkeypatch):
    """Each round runs every contender once, the order shifting by one every round; the load
    average is read before each round; ratios are of medians per round (their median and
    quartiles) and of the pooled medians."""
    samples = {  # seconds per round, as the contenders report them
        "a": [[2.0, 4.0, 9.0], [1.0], [3.0, 3.0]],  # medians, not means: 4, not 5
        "b": [[1.0, 2.0, 3.0], [2.0], [1.0, 1.5]],
        "c": [0.5, 0.25, 1.0],
    }
    order, lines = [], []
    loads = iter([1.5, 0.5, 2.5])
    monkeypatch.setattr(timing, "load_average", lambda: next(loads))

    def contender(name):
        rounds = iter(samples[name])

        def measure():
            order.append(name)
            result = next(rounds)
            return {"times": result, "extra": name} if name == "a" else result

        return measure

    rounds = timing.alternate({n: contender(n) for n in "abc"}, 3, log=lines.append,
                              describe=lambda r: "measured")  # fmt: skip
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert lines[0] == "round 1/3: load average 1.50" and lines[1] == "  a: measured"
    assert len(lines) == 12 and rounds.loads == [1.5, 0.5, 2.5]
    assert rounds.load_range() == "0.50-2.50"
    assert rounds.results["a"][0] == {"times": [2.0, 4.0, 9.0], "extra": "a"}
    assert rounds.times("c") == [[0.5], [0.25], [1.0]]
    assert rounds.round_medians("a") == [4.0, 1.0, 3.0]
    assert rounds.timing("a").median == 3.0  # of 1, 2, 3, 3, 4, 9

    r = rounds.ratio("a", "b")
    # per round: 4 / 2, 1 / 2, 3 / 1.25; pooled: median 3 over 1.75 (of 1, 1, 1.5, 2, 2, 3)
    assert r.per_round == pytest.approx((2.0, 0.5, 2.4))
    assert r.median == pytest.approx(2.0) and r.of_medians == pytest.approx(3.0 / 1.75)
    # inclusive quartiles of (0.5, 2, 2.4): halfway between neighbours
    assert (r.q1, r.q3) == pytest.approx((1.25, 2.2))
    r = rounds.ratio("c", "a")
    assert r.per_round == pytest.approx((0.125, 0.25, 1 / 3))
    assert r.of_medians == pytest.approx(0.5 / 3.0)

    order.clear()
    monkeypatch.setattr(timing, "load_average", lambda: None)  # a platform without one
    fixed = timing.alternate({"b": contender("b"), "c": contender("c")}, 2, rotate=False,
                             log=None)  # fmt: skip
    assert order == ["b", "c", "b", "c"]
    assert fixed.loads == [None, None] and fixed.load_range() == "unknown"
    with pytest.raises(ValueError):
        timing.ratio([[1.0]], [[1.0], [2.0]])


def test_no_measurement_keeps_a_timing_loop_of_its_own():
    """Every script in benchmarks/ and --mode time read the clock, the load and the device's
    queue through pycls.core.timing only."""
    own = re.compile(r"perf_counter\(\)|process_time\(\)|monotonic\(\)|getloadavg\(|"
                     r"synchronize\(|time\.time\(\)")  # fmt: skip
    paths = glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    paths.append(os.path.join(ROOT, "pycls", "core", "benchmark.py"))
    found = []
    for path in sorted(paths):
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if own.search(line):
                    found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_time_mode_reports_the_spread_of_each_phase(tmp_path):
    argv = ["--mode", "time", "--cfg", QUICKSTART, "OUT_DIR", str(tmp_path), "DEVICE", "cpu"]
    argv += ["TRAIN.BATCH_SIZE", "8", "PREC_TIME.WARMUP_ITER", "1", "PREC_TIME.NUM_ITER", "5"]
    argv += ["TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic"]
    assert cli.main(argv + TINY) == 0
    (s,) = [s for s in load_json_stats(tmp_path / "stdout.log") if s["_type"] == "iter_times"]
    for key in ("test_fw_time", "train_fw_bw_time", "train_step_time", "optim_step_time"):
        # the middle half's width: a spread, never negative (its size is the machine's, not ours)
        assert 0 <= s[f"{key}_iqr"] < float("inf") and s[key] > 0, key
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
    """One contender and the reference it is compared with (added by the tool), one process each;
    the table's median and ratio are the saved times' (checked to fail with the ratio taken the
    other way round, reference over contender)."""
    tool = load_tool("optimizer_step", folder="benchmarks")
    tool.main(["--tiny", "--threads", "1", "--rounds", "1", "--iters", "2", "--warmup", "0",
               "--only", "pycls_adamw", "--out", str(tmp_path)])  # fmt: skip
    table = (tmp_path / "optimizer.md").read_text()
    times = json.loads((tmp_path / "optimizer.json").read_text())
    ours, ref = (
        statistics.median(times[f"{key}|1"][0]) for key in ("pycls_adamw", "torch_fused_adamw")
    )
    assert f"| 1 | pycls AdamW | {ours * 1e3:.1f} |" in table
    assert f"| {ours / ref:.2f}x fused AdamW |" in table
    assert "| 1 | torch.optim.AdamW(fused=True) |" in table and "| 1.00x fused AdamW |" in table


@pytest.mark.slow  # three processes importing torch, timm and schedulefree
def test_optimizer_benchmark_times_other_libraries_optimizers_and_plots(tmp_path):
    """Schedule-Free and a timm name as OPTIM.OPTIMIZER builds them, beside torch's fused AdamW
    (added as their reference), and the plot of the ratios."""
    tool = load_tool("optimizer_step", folder="benchmarks")
    tool.main(["--tiny", "--threads", "1", "--rounds", "1", "--iters", "1", "--warmup", "0",
               "--only", "schedulefree_adamw", "timm:lion", "--plot",
               "--out", str(tmp_path)])  # fmt: skip
    table = (tmp_path / "optimizer.md").read_text()
    assert "| 1 | Schedule-Free AdamW (schedulefree, foreach) |" in table
    assert "| 1 | timm:lion |" in table and "x fused AdamW |" in table
    assert (tmp_path / "optimizer.png").stat().st_size > 0


class _Scaled(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.linear, self.scale = torch.nn.Linear(4, 4), scale

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.mark.parametrize("scales, eager", [([0.5] * 4, 0), ([0.5, 1.5, 2.5, 3.5], 2)])
def test_compile_stats_name_the_blocks_that_ran_eager(scales, eager):
    """Blocks compiled in place; where each specialises a float (as torch 2.10 does) past the
    recompile limit, the last blocks run eager: the probe counts them and the report warns."""
    config = torch._dynamo.config
    patch = {"recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit": 2}
    if hasattr(config, "specialize_float"):  # torch 2.10 and 2.11 specialise floats anyway
        patch["specialize_float"] = True
    torch._dynamo.reset()
    blocks = [_Scaled(s) for s in scales]
    for block in blocks:
        block.compile(backend="aot_eager")  # AOTAutograd's graphs, without inductor's compile
    probe = compile_stats.EagerBlockProbe(blocks)
    before = compile_stats.snapshot()
    x = torch.ones(2, 4, requires_grad=True)
    with config.patch(**patch):
        for _ in range(2):
            for block in blocks:
                x = block(x)
    fields, warning = compile_stats.report(
        compile_stats.delta(before, compile_stats.snapshot()), probe, len(blocks), True
    )
    torch._dynamo.reset()
    assert fields["eager_blocks"] == eager and fields["uncompiled"] == bool(eager)
    assert fields["unique_graphs"] == (1 if not eager else 2) and fields["compile_s"] > 0
    assert (warning is None) == (not eager)
    if eager:
        assert fields["frames_failed"] >= 1 and "2 of 4 blocks ran uncompiled" in warning
    probe.remove()


def test_time_mode_compiles_the_training_graphs_only(tmp_path, monkeypatch):
    """TRAIN.COMPILE True: the training graphs only, every block compiled, no warning; asking
    for the evaluation forward compiled (PREC_TIME.COMPILE_TEST) compiles more graphs. The
    blocks compile with AOTAutograd's eager backend here (inductor's code generation would take
    the test's time; what is counted is the same)."""
    compile_ = torch.nn.Module.compile

    def aot_eager(self, **kwargs):
        return compile_(self, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch.nn.Module, "compile", aot_eager)
    stats = {}
    for compile_test in ("False", "True"):
        torch._dynamo.reset()
        out = tmp_path / compile_test
        argv = ["--mode", "time", "--cfg", QUICKSTART, "OUT_DIR", str(out), "DEVICE", "cpu"]
        argv += ["TRAIN.BATCH_SIZE", "4", "PREC_TIME.WARMUP_ITER", "1", "PREC_TIME.NUM_ITER", "2"]
        argv += ["TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic", "VIT.DEPTH", "2"]
        argv += ["TRAIN.COMPILE", "True", "PREC_TIME.COMPILE_TEST", compile_test]
        assert cli.main(argv + TINY[2:]) == 0
        log = (out / "stdout.log").read_text()
        (stats[compile_test],) = [
            s for s in load_json_stats(out / "stdout.log") if s["_type"] == "iter_times"
        ]
        assert "WARNING" not in log and "compiled: " in log
    torch._dynamo.reset()
    train_only, with_test = stats["False"], stats["True"]
    assert (train_only["eager_blocks"], train_only["num_blocks"]) == (0, 2)
    assert train_only["frames_failed"] == 0 and train_only["uncompiled"] is False
    assert 1 <= train_only["unique_graphs"] <= 2 and train_only["compile_s"] > 0
    assert train_only["test_compiled"] is False and with_test["test_compiled"] is True
    assert with_test["unique_graphs"] > train_only["unique_graphs"]


def test_step_ab_tool_tiny(tmp_path):
    """Two variants of a tiny ViT and timm's, built once in one process, alternating rounds,
    a profile by category; then a deadline that leaves no time skips every variant, saying so."""
    tool = load_tool("step_ab", folder="benchmarks")
    argv = ["--cfg", os.path.join(ROOT, "configs", "vit_b16.yaml"), "--tiny",
            "--variant", "base", "", "--variant", "contiguous", "OPTIM.CONTIGUOUS_PARAMS True",
            "--rounds", "2", "--iters", "1", "--warmup", "1", "--profile", "base",
            "--torchvision"]  # fmt: skip
    if _has_timm():
        argv.append("--timm")
    rows = tool.main(argv + ["--out", str(tmp_path / "ab")])
    data = json.loads((tmp_path / "ab" / "step_ab.json").read_text())
    names = ["base"] + (["timm"] if _has_timm() else []) + ["torchvision", "contiguous"]
    assert [r["name"] for r in rows] == [r["name"] for r in data["rows"]] == names
    assert all(len(data["rounds"][n]) == 2 for n in names)  # the first turn + one round
    base, other = data["rows"][0], data["rows"][-1]
    assert base["verdict"] == "baseline" and base["images_per_sec"] > 0
    assert other["speedup"] == pytest.approx(
        statistics.median(data["rounds"]["base"]) / statistics.median(data["rounds"]["contiguous"])
    )
    assert other["verdict"].startswith(("wins", "no win")) and other["mfu_vs_matmul"] > 0
    assert other["compiled"] is False and other["eager_blocks"] is None
    cats = data["profiles"]["base"]
    assert {"GEMM", "attention", "element-wise", "optimizer", "idle"} <= set(cats)
    assert cats["GEMM"] > 0 and cats["optimizer"] > 0
    table = (tmp_path / "ab" / "step_ab.md").read_text()
    assert "| contiguous | `OPTIM.CONTIGUOUS_PARAMS True` |" in table and "| GEMM |" in table
    if _has_timm():
        assert data["versus"]["timm"]["ratio"] > 0 and data["rows"][1]["verdict"] == "contender"
    assert data["versus"]["torchvision"]["ratio"] > 0
    assert "no drop path" in data["rows"][-2]["overrides"]  # vit_b16.yaml has VIT.DROP_PATH 0.1
    tool.main(argv + ["--deadline-s", "0", "--out", str(tmp_path / "late")])
    late = json.loads((tmp_path / "late" / "step_ab.json").read_text())["rows"]
    assert [r.get("note") for r in late] == ["skipped: deadline"] * len(names)


def test_step_ab_verdicts():
    tool = load_tool("step_ab", folder="benchmarks")

    def row(name, speedup, **kw):
        return {"name": name, "kind": "pycls", "speedup": speedup, "compiled": True,
                "model_graphs": 2, "uncompiled": False, **kw}  # fmt: skip

    assert tool.verdict(row("a", 1.0), "a") == "baseline"
    assert tool.verdict(row("b", 1.05), "a") == "wins (+5.0%)"
    assert tool.verdict(row("b", 1.02), "a") == "no win (+2.0%)"
    assert tool.verdict(row("b", 1.2, model_graphs=3), "a") == "not comparable: 3 graphs"
    eager = row("b", 1.2, uncompiled=True, eager_blocks=4)
    assert tool.verdict(eager, "a") == "not comparable: ran eager (4 blocks)"


def test_attention_backends_tool_tiny(tmp_path):
    """Every backend forced alone and torch's own choice, named from the operator it runs; on a
    CPU the math and flash kernels run and cuDNN / efficient say they cannot."""
    tool = load_tool("attention_backends", folder="benchmarks")
    rows = tool.main(["--tiny", "--iters", "1", "--samples", "1", "--warmup", "0",
                      "--dtype", "float32", "--out", str(tmp_path)])  # fmt: skip
    assert len(rows) == len(tool.TINY_SHAPES) * 2 * 5
    by = {(r["shape"], r["pass"], r["backend"]): r for r in rows}
    for shape in tool.TINY_SHAPES:
        for passes in tool.PASSES:
            default = by[(shape, passes, "default")]
            assert default["picks"] in tool.OPERATORS.values() and default["ms"] > 0
            assert by[(shape, passes, "math")]["tflops"] > 0
            assert by[(shape, passes, "cudnn")]["note"].startswith("unsupported here")
    b, h, n, d = tool.SHAPES["vit_b16"]
    assert tool.attention_flops((b, h, n, d), "forward") == 4 * b * h * n * n * d
    table = (tmp_path / "attention.md").read_text()
    assert "| default (picks " in table and json.loads((tmp_path / "attention.json").read_text())
