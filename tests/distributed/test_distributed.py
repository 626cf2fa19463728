"""Multi-process training on the CPU (gloo): launchers, DDP, FSDP2, pipeline, sharded checkpoints.

The engines are checked against one process: the same initial weights, the same samples per step
(each process takes its shard of the global batch), 5 optimizer steps, then losses and weights are
compared with explicit tolerances. Processes are started with torch.multiprocessing (one start for
all engines, results shared through files) or, end to end, with torchrun / NUM_PROCS on
tools/run_net.py. Every spawned process runs one intra-op thread: the machine may have 2 cores.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pycls import distributed
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint import single_file as checkpoint
from pycls.config import ConfigError
from pycls.core import builders
from pycls.distributed import preemption
from pycls.distributed.preflight import check_launch
from pycls.engines.loss_scaling import AgreeingLossScaler
from pycls.errors import WaitStopped
from pycls.models.vit import pipeline_cut as pipeline
from tests.helpers import QUICKSTART, ROOT, RUN_NET, scaled
from tests.helpers.distributed import (
    LOSS_RTOL,
    STEPS,
    TINY_GLOO,
    assert_weights_close,
    batches,
    build,
    init_gloo,
    run_steps,
    spawn,
    tiny_cfg,
)
from tests.helpers.warm import run as warm_run

# Engines compared with one process; each is one TRAIN.PARALLEL and its extra overrides
ENGINES = {
    "ddp": ["TRAIN.PARALLEL", "ddp"],
    "fsdp": ["TRAIN.PARALLEL", "fsdp"],
    "fsdp_keep": ["TRAIN.PARALLEL", "fsdp", "FSDP.RESHARD_AFTER_FORWARD", "False"],
    "gpipe": ["TRAIN.PARALLEL", "pipeline", "PIPELINE.SCHEDULE", "gpipe"],
    "1f1b": ["TRAIN.PARALLEL", "pipeline", "PIPELINE.BALANCE", "params"],
    "interleaved": [
        "TRAIN.PARALLEL", "pipeline", "PIPELINE.SCHEDULE", "interleaved_1f1b",
        "PIPELINE.STAGES_PER_RANK", "2",
    ],
    # gradient accumulation over 2 micro-batches (sync=False); the pipeline's then has
    # micro-batches of one image
    "ddp_accum": ["TRAIN.PARALLEL", "ddp"],
    "fsdp_accum": ["TRAIN.PARALLEL", "fsdp"],
    "1f1b_accum": ["TRAIN.PARALLEL", "pipeline"],
}  # fmt: skip

# What imported timm models use beyond the classic ViT: every stage of a pipeline must carry it
VIT_OPTIONS = [
    "VIT.PRE_NORM", "True", "VIT.FC_NORM", "True", "VIT.CLASSIFIER", "pooled",
    "VIT.CLASS_TOKEN", "True", "VIT.NUM_REGISTERS", "2",
]  # fmt: skip

# ------------------------------------------------------------------------------------------------ #
# The engines against one process (one spawn of 2 processes for all of them)
# ------------------------------------------------------------------------------------------------ #


def _engines_worker(rank, world, port, out_dir):
    init_gloo(rank, world, port)
    try:
        cfg = tiny_cfg()
        data = batches(cfg)
        results = {}
        for name, overrides in ENGINES.items():
            ecfg = tiny_cfg(*overrides)
            accum = 2 if name.endswith("_accum") else 1
            engine, optimizer, losses = run_steps(ecfg, data, rank, world, accum)
            weights = engine.full_state_dict()
            results[name] = {"losses": losses, "weights": weights if rank == 0 else None}
            if name in ("fsdp", "1f1b"):  # sharded checkpoints, to load in one process
                path = engine.save(
                    out_dir, 1 if name == "fsdp" else 2, optimizer=optimizer,
                    cfg_yaml=ecfg.dump(), extra={"marker": name},
                )  # fmt: skip
                if rank == 0:
                    results[name]["path"] = path
                    results[name]["optimizer_steps"] = _optimizer_steps(optimizer)
        # the pipeline with the options of imported weights (timm's pre_norm, fc_norm, registers)
        engine, _, losses = run_steps(tiny_cfg(*ENGINES["1f1b"], *VIT_OPTIONS), data, rank, world)
        weights = engine.full_state_dict()
        results["1f1b_vit_options"] = {"losses": losses, "weights": weights if rank == 0 else None}
        # AMP O2 under FSDP: fp32 shards are the master weights, the optimizer keeps none
        o2 = tiny_cfg("TRAIN.PARALLEL", "fsdp", "AMP.LEVEL", "O2")
        engine, optimizer, losses = run_steps(o2, data, rank, world)
        dtypes = {str(p.dtype) for p in engine.module.parameters()}
        results["fsdp_o2"] = {"losses": losses, "dtypes": dtypes, "master": _has_master(optimizer)}
        # float16 loss scaling: an overflow in one process's shard skips the step everywhere
        scaler = AgreeingLossScaler(torch.device("cpu"))
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.full((3,), float("inf") if rank == 1 else 1.0)
        results["overflow_step_taken"] = scaler.step(torch.optim.SGD([p], lr=0.1))
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "engines.pt"))
    finally:
        distributed.destroy_process_group()


def _has_master(optimizer):
    return any("master" in state for state in optimizer.state.values())


def _optimizer_steps(optimizer):
    return sorted({float(s["step"]) for s in optimizer.state.values()})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One 2-process run of every engine, and the one-process reference."""
    out = str(tmp_path_factory.mktemp("engines"))
    start = time.perf_counter()
    spawn(_engines_worker, 2, out)
    results = torch.load(os.path.join(out, "engines.pt"), weights_only=False)
    print(f"2-process engines: {time.perf_counter() - start:.1f} s")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine, _, losses = run_steps(tiny_cfg(), batches(tiny_cfg()))
    finally:
        torch.set_num_threads(threads)
    return results, {"losses": losses, "weights": engine.module.state_dict()}, out


@pytest.mark.parametrize("name", list(ENGINES))
def test_engine_matches_one_process(engines, name):
    results, ref, _ = engines
    got = results[name]
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0
    )
    assert_weights_close(got["weights"], ref["weights"])
    # the run really trained: the weights moved away from their start
    start = build(tiny_cfg())[0].module.state_dict()
    assert not torch.allclose(ref["weights"]["head.weight"], start["head.weight"])


def test_pipeline_carries_pre_norm_fc_norm_class_token_and_registers(engines):
    """The stages hold norm_pre, the register tokens, fc_norm: 2 processes match one."""
    got = engines[0]["1f1b_vit_options"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine, _, losses = run_steps(tiny_cfg(*VIT_OPTIONS), batches(tiny_cfg()))
    finally:
        torch.set_num_threads(threads)
    ref = engine.module.state_dict()
    assert {"norm_pre.weight", "fc_norm.weight", "register_tokens", "class_token"} <= set(ref)
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(losses), rtol=LOSS_RTOL, atol=0
    )
    assert_weights_close(got["weights"], ref)


def test_fsdp_amp_o2_keeps_fp32_shards_as_master_weights(engines):
    results, _, _ = engines
    got = results["fsdp_o2"]
    assert got["dtypes"] == {"torch.float32"} and not got["master"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one process at O2: bf16 weights with fp32 masters in the optimizer, the same rounding
        model, optimizer, losses = run_steps(tiny_cfg("AMP.LEVEL", "O2"), batches(tiny_cfg()))
    finally:
        torch.set_num_threads(threads)
    assert _has_master(optimizer)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-2, atol=0)


def test_loss_scaler_skips_an_overflow_in_any_process(engines):
    assert engines[0]["overflow_step_taken"] is False


@pytest.mark.parametrize("name", ["fsdp", "1f1b"])
def test_sharded_checkpoint_of_two_processes_loads_in_one(engines, name):
    """The DCP folder 2 processes wrote loads into a plain model and optimizer in this process:
    the weights are exactly those of the run, and the optimizer state is complete."""
    results, _, _ = engines
    path = results[name]["path"]
    assert os.path.isdir(path) and not os.path.exists(f"{path}.tmp")
    cfg = tiny_cfg()
    engine, optimizer, scaler, _, _ = build(cfg, seed=123)  # other weights, fresh optimizer
    state = sharded_checkpoint.read_state(path)
    engine.load(path, state, optimizer=optimizer, scaler=scaler)
    model = engine.module
    assert state["epoch"] in (1, 2) and state["marker"] == name and state["world_size"] == 2
    for k, v in results[name]["weights"].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert _optimizer_steps(optimizer) == [float(STEPS)]
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert {"exp_avg", "exp_avg_sq"} <= set(optimizer.state[p]), group["name"]
    # and it is the newest checkpoint for auto-resume, folder or not
    out_dir = os.path.dirname(os.path.dirname(path))
    assert checkpoint.get_last_checkpoint(out_dir).endswith("model_epoch_0002")


def test_consolidate_sharded_checkpoint(engines, tmp_path):
    results, _, _ = engines
    single = sharded_checkpoint.consolidate(results["fsdp"]["path"], str(tmp_path / "w.pyth"))
    model = build(tiny_cfg(), seed=7)[0].module
    checkpoint.load_model_weights(single, model)
    for k, v in results["fsdp"]["weights"].items():
        assert torch.equal(model.state_dict()[k], v), k
    # the command-line tool writes the same weights
    tool = os.path.join(ROOT, "tools", "consolidate_checkpoint.py")
    out = str(tmp_path / "tool.pyth")
    proc = warm_run([sys.executable, tool, results["fsdp"]["path"], "--out", out])
    assert proc.returncode == 0, proc.stderr
    again = build(tiny_cfg(), seed=7)[0].module
    checkpoint.load_model_weights(out, again)
    for k, v in results["fsdp"]["weights"].items():
        assert torch.equal(again.state_dict()[k], v), k


# ------------------------------------------------------------------------------------------------ #
# Pieces that need no second process
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node07", "node07"),
        ("gpu[003-010,012]", "gpu003"),
        ("gpu[12,3-4],cpu01", "gpu12"),
        ("rack[1-2]-n[01-04],login1", "rack1-n01"),
        ("a,b", "a"),
    ],
)
def test_parse_first_slurm_host(nodelist, first):
    assert distributed.parse_first_host(nodelist) == first


def test_launcher_env_torchrun_then_slurm():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0",
                "MASTER_PORT": "1234"}  # fmt: skip
    env = distributed.launcher_env(torchrun)
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 8, 1, "torchrun")
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}  # fmt: skip
    env = distributed.launcher_env(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "slurm")
    assert env.master_port == 15000 + 4242 % 20000
    assert env.master_addr == "gpu07"
    # the batch script itself (no job step) and single tasks are not multi-process runs
    del slurm["SLURM_STEP_ID"]
    assert distributed.launcher_env(slurm) is None
    assert distributed.launcher_env({**slurm, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}) is None
    assert distributed.launcher_env({}) is None


def test_the_machines_a_launcher_describes():
    """node_layout: (machines, processes per machine) where the launcher says and every machine
    holds the same number of consecutive ranks; node_replicas: HSDP's default, one replica per
    machine where whole tensor-parallel groups fit one and no pipeline stages run. Checked to
    fail with srun's node id left unchecked (a cyclic distribution then reads as 2 x 4)."""
    from pycls.distributed.mesh_layout import node_replicas

    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "GROUP_RANK": "1"}  # fmt: skip
    assert distributed.node_layout(torchrun) == (2, 4)
    assert distributed.node_layout({**torchrun, "GROUP_RANK": "0"}) is None  # not consecutive
    assert distributed.node_layout({**torchrun, "LOCAL_WORLD_SIZE": "3"}) is None  # uneven
    del torchrun["LOCAL_WORLD_SIZE"]
    assert distributed.node_layout(torchrun) is None  # it does not say
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}  # fmt: skip
    assert distributed.node_layout(srun) == (2, 4)
    assert distributed.node_layout({**srun, "SLURM_NODEID": "0"}) is None  # cyclic
    assert distributed.node_layout({**srun, "SLURM_STEP_TASKS_PER_NODE": "5,3"}) is None
    assert distributed.node_layout({**srun, "SLURM_STEP_TASKS_PER_NODE": "4(x3)"}) is None
    assert distributed.node_layout({}) is None
    # 2 machines of 4: dp 8 -> 2 replicas; tp 2 -> dp 4, 2 replicas of 2 x tp 2; tp 8 spans both
    assert node_replicas(8, 1, 1, 2, 4) == 2 and node_replicas(4, 2, 1, 2, 4) == 2
    assert node_replicas(1, 8, 1, 2, 4) == 1 and node_replicas(2, 2, 2, 2, 4) == 1
    assert node_replicas(8, 1, 1, 1, 8) == node_replicas(8) == 1


def test_partition_balances_blocks_and_params():
    assert pipeline.partition([1] * 4, 2) == [range(0, 2), range(2, 4)]
    assert [len(r) for r in pipeline.partition([1] * 5, 2)] == [2, 3]  # the first stage lighter
    # a heavy embedding pushes blocks to the later stages
    assert pipeline.partition([1] * 6, 3, first_extra=2) == [range(0, 1), range(1, 3), range(3, 6)]
    with pytest.raises(ValueError):
        pipeline.partition([1] * 2, 3)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale"], "FSDP.BACKEND"),
        (["TRAIN.PARALLEL", "fsdp", "OPTIM.CONTIGUOUS_PARAMS", "True"], "OPTIM.CONTIGUOUS_PARAMS"),
        (["TRAIN.PARALLEL", "pipeline", "PIPELINE.STAGES", "5"], "PIPELINE.STAGES"),
        (["TRAIN.PARALLEL", "pipeline", "PIPELINE.SCHEDULE", "interleaved_1f1b"],
         "PIPELINE.STAGES_PER_RANK"),
        (["TRAIN.PARALLEL", "pipeline", "PIPELINE.STAGES_PER_RANK", "2"],
         "PIPELINE.STAGES_PER_RANK"),
        (["TRAIN.PARALLEL", "pipeline", "PIPELINE.MICRO_BATCHES", "3"], "PIPELINE.MICRO_BATCHES"),
    ],
)  # fmt: skip
def test_impossible_settings_fail_before_any_work(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_launch(builders.launch_settings(tiny_cfg(*overrides)), world_size=2)


def test_cli_reports_a_parallel_config_error():
    out = warm_run(
        [sys.executable, RUN_NET, "--mode", "train", "--cfg", QUICKSTART, "DEVICE", "cpu",
         "TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale"],
        timeout=scaled(120),
    )  # fmt: skip
    assert out.returncode == 2
    assert "config error: FSDP.BACKEND" in out.stderr and "CUDA" in out.stderr


def test_last_checkpoint_sees_folders_and_mid_epoch_files(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    (d / "model_epoch_0002.pyth").write_bytes(b"")
    assert checkpoint.get_last_checkpoint(str(tmp_path)).endswith("model_epoch_0002.pyth")
    (d / "model_epoch_0002_iter_000030").mkdir()  # a preempted sharded run, mid-epoch 3
    assert checkpoint.get_last_checkpoint(str(tmp_path)).endswith("model_epoch_0002_iter_000030")
    (d / "model_epoch_0003.tmp").mkdir()  # an interrupted save: never resumed from
    (d / "model_epoch_0003").write_bytes(b"")  # a file without suffix is not a checkpoint
    assert checkpoint.get_last_checkpoint(str(tmp_path)).endswith("model_epoch_0002_iter_000030")
    (d / "model_epoch_0003").unlink()
    (d / "model_epoch_0003").mkdir()
    assert checkpoint.get_last_checkpoint(str(tmp_path)).endswith("model_epoch_0003")


def test_preemption_flag_is_set_by_signals():
    before = signal.getsignal(signal.SIGUSR1)
    flag = distributed.PreemptionFlag().install()
    try:
        assert not flag.agreed(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert flag.agreed(torch.device("cpu"))
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def _catches(pid, sig):
    """Whether process ``pid`` has a Python handler for ``sig`` (Linux: SigCgt in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (sig - 1) & 1)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads signal masks in /proc")
def test_stop_signal_during_start_up_still_checkpoints(tmp_path):
    """SLURM's --signal=USR1@N can come while run_net.py is still importing torch: the run must
    not die of it, but checkpoint at its first sync point and exit 75 like any preempted run."""
    cmd = [sys.executable, RUN_NET, "--mode", "train", "--cfg", QUICKSTART, *TINY_GLOO,
           "OPTIM.MAX_EPOCH", "1", "DEVICE", "cpu", "OUT_DIR", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # As soon as it listens, and at the latest after 1 s: well before torch is imported and
    # the trainer installs its own handler (several seconds here)
    deadline = time.time() + scaled(1.0)
    while not _catches(proc.pid, signal.SIGUSR1) and time.time() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=scaled(300))[0]
    assert proc.returncode == distributed.PREEMPTED_EXIT_CODE, out[-3000:]
    assert checkpoint.get_last_checkpoint(str(tmp_path)) is not None


@pytest.fixture
def group_of_one():
    """A gloo process group of this process alone."""
    distributed.init_single_process_group("cpu")
    yield torch.device("cpu")
    distributed.destroy_process_group()


def test_fairscale_wrapping_keeps_weight_decay_groups_apart(group_of_one):
    """FairScale flattens each instance's parameters into one tensor; ours hold the decay and
    no-decay parameters in separate flat parameters, so the optimizer's groups keep their sizes.
    (Its forward needs CUDA; the GPU tests train it.)"""
    pytest.importorskip("fairscale")
    from pycls.core import builders
    from pycls.engines.fairscale import wrap_fairscale
    from pycls.engines.precision import Precision
    from pycls.optim import param_groups

    def sizes(model):
        return {g["name"]: sum(p.numel() for p in g["params"]) for g in param_groups(model, 0.1)}

    cfg = tiny_cfg("TRAIN.PARALLEL", "fsdp", "FSDP.BACKEND", "fairscale")
    model = builders.build_model(cfg)
    want = sizes(model)
    wrapped = wrap_fairscale(model, builders.engine_settings(cfg), group_of_one, Precision("O1"))
    assert sizes(wrapped) == want
    assert all(n.endswith(("flat_param_0", "flat_param_1")) for n, _ in wrapped.named_parameters())


def test_no_sync_is_a_no_op_in_one_process():
    from pycls.engines.precision import Precision
    from pycls.engines.settings import EngineSettings
    from pycls.engines.single_process import SingleProcess

    model = torch.nn.Linear(2, 2)
    engine = SingleProcess(model, EngineSettings(), torch.device("cpu"), Precision("O0"))
    with engine.no_sync(sync=False):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None


# ------------------------------------------------------------------------------------------------ #
# End to end: tools/run_net.py under torchrun and NUM_PROCS
# ------------------------------------------------------------------------------------------------ #

# One epoch of the quickstart on the digits: ~45 steps of 32 images
# The quickstart cut to a small model (2 blocks: the pipeline needs one per stage) for one epoch:
# what these runs prove does not need the quickstart's width, and a quarter of the work
SMALL = ["VIT.DEPTH", "2", "VIT.WIDTH", "32", "VIT.NUM_HEADS", "2", "VIT.MLP_DIM", "64"]
SHORT = [*SMALL, "OPTIM.MAX_EPOCH", "1", "DEVICE", "cpu", "LOG_PERIOD", "20"]


def run_net(out_dir, *overrides, torchrun=False, timeout=300, short=True):
    cmd = [sys.executable, RUN_NET]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", RUN_NET]
    cmd += ["--mode", "train", "--cfg", QUICKSTART, "OUT_DIR", str(out_dir)]
    cmd += [*(SHORT if short else ["DEVICE", "cpu"]), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = warm_run(cmd, env=env, timeout=scaled(timeout))  # torchrun: a fresh process
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return stats_of(out_dir)


def stats_of(out_dir):
    stats = {}
    with open(os.path.join(out_dir, "stdout.log")) as f:
        for line in f:
            if "json_stats: " in line:
                s = json.loads(line.split("json_stats: ", 1)[1])
                stats.setdefault(s["_type"], []).append(s)
    return stats


# torchrun with ddp, fsdp and pipeline on the quickstart, matched against one process: the steps
# of docs/distributed.md (tests/docs/test_readme.py), which were these tests' until 2026-11


@pytest.mark.slow
def test_num_procs_fsdp_resumes_in_one_process(tmp_path):
    """NUM_PROCS 2 spawns the processes; their sharded checkpoint (weights and the EMA's shards)
    resumes in one process without an engine."""
    stats = run_net(tmp_path, "TRAIN.PARALLEL", "fsdp", "NUM_PROCS", "2", "TRAIN.EMA", "True")
    path = str(tmp_path / "checkpoints" / "model_epoch_0001")
    assert os.path.isfile(os.path.join(path, "train_state.pyth"))
    best = checkpoint.load_file(checkpoint.get_best_checkpoint_path(str(tmp_path)))
    assert best["model_state"]["pos_embed"].shape == (1, 16, 32)  # gathered, not a shard
    # one process, no engine: nothing left to train, evaluates what it loaded
    again = run_net(tmp_path, "TRAIN.EMA", "True")
    for kind in ("test_epoch", "test_epoch_ema"):
        first, second = stats[kind][-1], again[kind][-1]
        assert second["top1_err"] == pytest.approx(first["top1_err"], abs=0.5)
        assert second["loss"] == pytest.approx(first["loss"], abs=2e-3)


@pytest.mark.slow
def test_preempted_run_checkpoints_and_resumes_exactly(tmp_path):
    """SIGUSR1 mid-run: a checkpoint at the next LOG_PERIOD boundary, exit status 75; the resumed
    run ends with the weights of a run never stopped."""
    args = ["OPTIM.MAX_EPOCH", "2", "LOG_PERIOD", "5", "TRAIN.CHECKPOINT_PERIOD", "2"]
    cmd = [sys.executable, RUN_NET, "--mode", "train", "--cfg", QUICKSTART, "DEVICE", "cpu",
           *SMALL, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(
        [*cmd, "OUT_DIR", str(stopped)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    for line in proc.stdout:  # the first train_iter line: training is under way
        if '"train_iter"' in line:
            proc.send_signal(signal.SIGUSR1)
            break
    proc.stdout.read()
    assert proc.wait(timeout=scaled(300)) == distributed.PREEMPTED_EXIT_CODE
    last = checkpoint.get_last_checkpoint(str(stopped))
    assert last is not None and ("_iter_" in last or last.endswith("0001.pyth")), last
    resumed = warm_run([*cmd, "OUT_DIR", str(stopped)], env=env, timeout=scaled(300))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = tmp_path / "straight"
    assert warm_run([*cmd, "OUT_DIR", str(straight)], env=env, timeout=scaled(300)).returncode == 0
    a = checkpoint.load_file(checkpoint.get_checkpoint_path(str(stopped), 2))["model_state"]
    b = checkpoint.load_file(checkpoint.get_checkpoint_path(str(straight), 2))["model_state"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------------ #
# Pipeline x DDP on 4 processes (2 replicas of a 2-stage pipeline)
# ------------------------------------------------------------------------------------------------ #


def _two_d_worker(rank, world, port, out_dir):
    init_gloo(rank, world, port)
    try:
        cfg = tiny_cfg("TRAIN.PARALLEL", "pipeline")
        engine, optimizer, losses = run_steps(cfg, batches(cfg), rank, world)
        assert engine.model.dp_size == 2
        weights = engine.full_state_dict()
        path = engine.save(out_dir, 1, optimizer=optimizer, cfg_yaml=cfg.dump())
        if rank == 0:
            result = {"losses": losses, "weights": weights, "path": path}
            torch.save(result, os.path.join(out_dir, "2d.pt"))
    finally:
        distributed.destroy_process_group()


def test_pipeline_with_data_parallel_replicas_matches_one_process(engines, tmp_path):
    spawn(_two_d_worker, 4, str(tmp_path))
    got = torch.load(tmp_path / "2d.pt", weights_only=False)
    _, ref, _ = engines
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0
    )
    assert_weights_close(got["weights"], ref["weights"])
    # its sharded checkpoint (4 processes: 2 stages x 2 replicas) resumes in one process, whole
    engine, optimizer, scaler, _, _ = build(tiny_cfg(), seed=123)
    state = sharded_checkpoint.read_state(got["path"])
    engine.load(got["path"], state, optimizer=optimizer, scaler=scaler)
    assert state["world_size"] == 4
    for k, v in got["weights"].items():
        assert torch.equal(engine.module.state_dict()[k], v), k
    assert _optimizer_steps(optimizer) == [float(STEPS)]
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert {"exp_avg", "exp_avg_sq"} <= set(optimizer.state[p]), group["name"]


@pytest.mark.slow
def test_ddp_curriculum_matches_one_process(tmp_path):
    """The curriculum resizes the position embedding between epochs; under DDP the model is
    wrapped anew each time (DDP sized its buckets for the old shape) and still trains exactly as
    one process does."""
    cur = ["CURRICULUM.ENABLED", "True", "CURRICULUM.START_SIZE", "8", "CURRICULUM.STEP", "4",
           "OPTIM.MAX_EPOCH", "2", "VIT.DEPTH", "1"]  # fmt: skip
    ref = run_net(tmp_path / "one", *cur)
    got = run_net(tmp_path / "ddp", *cur, "TRAIN.PARALLEL", "ddp", torchrun=True)
    assert [s["im_size"] for s in got["train_epoch"]] == [8, 12]
    for a, b in zip(got["train_epoch"], ref["train_epoch"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_a_wait_a_stop_ended_checkpoints_with_one_process_and_exits_with_several(monkeypatch):
    """``stop_at`` (the trainer's step and evaluation): a WaitStopped inside calls the stop with
    the point (its checkpoint) in one process; with several, where the others may be inside a
    collective of the next step, it exits with the stop's status and no checkpoint. Before, a
    wait for data was not ended by a stop at all."""
    stopped = []

    def stop(*point):
        stopped.append(point)
        raise distributed.Preempted()

    with pytest.raises(distributed.Preempted), distributed.stop_at(stop, 3, 7):
        raise WaitStopped("SIGTERM ended the wait for http://x/a.tar")
    assert stopped == [(3, 7)]
    monkeypatch.setattr(preemption, "get_world_size", lambda: 2)
    with pytest.raises(distributed.Preempted) as err, distributed.stop_at(stop, 3, 8):
        raise WaitStopped("SIGTERM ended the wait for http://x/a.tar")
    assert stopped == [(3, 7)] and err.value.code == distributed.PREEMPTED_EXIT_CODE
    with distributed.stop_at(stop, 3, 9):  # no wait ended: nothing happens
        pass
    assert stopped == [(3, 7)]
