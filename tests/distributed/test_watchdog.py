"""A hung run found and named (TRAIN.HANG_TIMEOUT), on the CPU with two gloo processes under DDP:
a test hook (``watchdog.BEFORE_COLLECTIVE``) blocks rank 1 in Python before the collective of a
step of epoch 2, or stops it (SIGSTOP). The facts asserted: the run exits with status 1; one line
in rank 0's log names rank 1 as the one that did not reach the collective (blocked) or as not
responding (stopped); the stacks of the processes that could still run are under OUT_DIR/hang
(the blocked one's shows the hook, the stopped one has none); the launcher gets the same line;
the rerun resumes from the epoch-1 checkpoint and ends with the weights of a run never stopped,
bitwise. And a stop signal that comes while the processes are blocked is honoured within seconds
(exit status 75, stacks written), where the loop itself would never reach its stop.

The watchdog's period is half a second here, its timeout three: a hung run exits about five
seconds after its hang; each run's time limit is 20x its idle time, scaled with the load."""

import os
import pickle
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from pycls import distributed as dist
from pycls.core import trainer
from pycls.distributed import watchdog
from tests.helpers import json_stats_of, scaled, tiny_quickstart, warm
from tests.helpers.distributed import init_gloo

# Two epochs of 11 steps, a checkpoint after each; the hook acts at step 13 (epoch 2's second)
RUN = ["TRAIN.PARALLEL", "ddp", "OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_PERIOD", "1",
       "TRAIN.BATCH_SIZE", "128", "TRAIN.HANG_TIMEOUT", "3",
       "TRAIN.HANG_CHECK_PERIOD", "0.5"]  # fmt: skip
HUNG_STEP = 12  # steps done when rank 1 blocks
BLOCKED = "blocked"  # the file the hook writes once rank 1 is about to block


def _block_before_the_collective(out):
    def hook(where, steps):
        if steps == HUNG_STEP and where == "forward and backward":
            open(os.path.join(out, BLOCKED), "w").close()
            threading.Event().wait()  # in Python, forever: only the watchdog's exit ends it

    return hook


def _stop_before_the_collective(out):
    def hook(where, steps):
        if steps == HUNG_STEP and where == "forward and backward":
            os.kill(os.getpid(), signal.SIGSTOP)

    return hook


HOOKS = {"block": _block_before_the_collective, "stop": _stop_before_the_collective}


def _train(rank, world, port, out, hook, overrides):
    init_gloo(rank, world, port)
    if hook and rank == 1:
        watchdog.BEFORE_COLLECTIVE = HOOKS[hook](out)
    try:
        trainer.train_model(tiny_quickstart(out, *RUN, *overrides))
    finally:
        dist.destroy_process_group()


def _limit(idle):
    return scaled(20 * idle)


def _run(out, hook=None, overrides=(), idle=15, signal_after_block=None):
    """Trains in two warm processes; returns (the first non-zero exit status or 0, the launcher's
    store, seconds from the signal to the exit). ``signal_after_block``: sent to both processes
    once rank 1 has blocked."""
    os.makedirs(out, exist_ok=True)
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, world_size=3, is_master=True, wait_for_workers=False
    )
    ctx = warm.start_processes(_train, args=(2, store.port, str(out), hook, list(overrides)),
                               nprocs=2, join=False)  # fmt: skip
    deadline, signalled = time.monotonic() + _limit(idle), None
    try:
        while not ctx.join(timeout=0.2, grace_period=2):
            if signal_after_block and signalled is None and os.path.exists(out / BLOCKED):
                time.sleep(0.5)  # rank 0 is in the collective by now
                signalled = time.monotonic()
                for pid in ctx.pids():
                    os.kill(pid, signal_after_block)
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the run did not end within {_limit(idle):.0f} s")
        code = 0
    except torch.multiprocessing.ProcessExitedException as e:
        code = e.exit_code
    took = time.monotonic() - signalled if signalled else None
    return code, store, took


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("never_stopped")
    assert _run(out)[0] == 0
    return out


def _hang_lines(out):
    with open(out / "stdout.log") as f:
        return [line for line in f if "hang: " in line]


def _assert_resumes_exactly(out, never_stopped):
    assert _run(out)[0] == 0
    assert json_stats_of(out, "resume")[-1]["epoch"] == 1
    ours, ref = (load_file(d / "model_final.safetensors") for d in (out, never_stopped))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_a_rank_blocked_before_a_collective_is_named_with_every_stack(never_stopped, tmp_path):
    """Caught: a watchdog that names nobody (the mark placed after the hook: every process at
    one count)."""
    out = tmp_path / "blocked"
    code, store, _ = _run(out, "block")
    assert code == 1
    lines = _hang_lines(out)
    assert len(lines) == 1, lines
    assert "rank(s) 1 did not reach the collective ranks 0 wait in" in lines[0]
    assert "not responding" not in lines[0]
    stacks = {r: (out / "hang" / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert "test_watchdog.py" in stacks[1] and "in hook" in stacks[1]  # where it blocked
    assert "forward_backward" in stacks[0]  # waiting in DDP's collectives
    line = lines[0][lines[0].index("hang: ") :].strip()
    assert store.get(dist.ENVIRONMENT_ERROR_KEY).decode() == f"error: {line}"  # NUM_PROCS' parent
    _assert_resumes_exactly(out, never_stopped)


@pytest.mark.slow
def test_a_stopped_rank_is_named_as_not_responding(never_stopped, tmp_path):
    """Caught: a stopped process taken for one that answered (any process with a record)."""
    out = tmp_path / "stopped"
    code, _, _ = _run(out, "stop")
    assert code == 1
    lines = _hang_lines(out)
    assert len(lines) == 1, lines
    assert "rank(s) 1 not responding" in lines[0] and "did not reach" not in lines[0]
    assert (out / "hang" / "rank0.txt").exists() and not (out / "hang" / "rank1.txt").exists()
    _assert_resumes_exactly(out, never_stopped)


@pytest.mark.slow
def test_a_stop_signal_is_honoured_while_the_ranks_are_blocked(tmp_path):
    """SIGTERM to both processes while rank 1 is blocked in Python and rank 0 in the all-reduce
    (the hang's own timeout a minute away): both exit with status 75 within seconds, their
    stacks written. Caught: a run that waits for its stop point (which it never reaches)."""
    out = tmp_path / "signalled"
    code, _, took = _run(out, "block", ["TRAIN.HANG_TIMEOUT", "60"],
                         signal_after_block=signal.SIGTERM)  # fmt: skip
    assert code == dist.PREEMPTED_EXIT_CODE
    assert took < 15, took  # the grace: max(3 periods, 3 x the longest step)
    for r in (0, 1):
        assert (out / "hang" / f"rank{r}.txt").read_text().startswith(f"rank {r} of 2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_runs_with_the_flight_recorder_and_a_hang_writes_its_record(tmp_path, monkeypatch):
    """On CUDA the process group starts with torch's flight recorder on (unless the environment
    says otherwise), and the stacks a hang writes come with the record of the collectives, an
    all-reduce here, for torch's ``fr_trace`` analyser."""
    for key in dist.FLIGHT_RECORDER:
        monkeypatch.delenv(key, raising=False)
    dist.init_single_process_group("cuda")
    try:
        assert all(os.environ[k] == v for k, v in dist.FLIGHT_RECORDER.items())
        torch.distributed.all_reduce(torch.ones(4, device="cuda"))
        torch.cuda.synchronize()
        watchdog.Watchdog(600, 5, str(tmp_path))._write_stack("a test")
    finally:
        dist.destroy_process_group()
    with open(tmp_path / "hang" / "flight_recorder" / "rank_0", "rb") as f:
        record = pickle.load(f)  # written by this test's own process
    names = [str(e.get("profiling_name", "")) for e in record.get("entries", [])]
    assert any("all_reduce" in n for n in names), names
