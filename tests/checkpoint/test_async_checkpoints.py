"""Checkpoints written in the background (TRAIN.ASYNC_CHECKPOINT): the very files a synchronous
write makes, at most one write in flight (the next save waits and says so), nothing visible and
nothing left behind by a write that fails between any two of its stages
(``async_writes.STAGES``), and a stop, the end of the run and an error each waiting for the write
in flight. Every fault comes from the write's own hooks (``async_writes.FAULT_HOOKS``), no timer:
a hook that must wait for the loop waits on an event the loop's own log line sets.

One file (engine none) in this process; a DCP folder (FSDP2) in a spawned group of two, where a
fault in one process must fail the write in both."""

import errno
import logging
import os
import signal
import threading

import pytest
import torch

from pycls import distributed as dist
from pycls.checkpoint import async_writes, files, sharded
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint.files import CheckpointWriteError
from pycls.core import trainer
from pycls.core.run_checkpoints import RunCheckpoints
from tests.helpers import json_stats_of, load_tool, resume_from, tiny_quickstart
from tests.helpers.distributed import batches, build, init_gloo, spawn, tiny_cfg

pytestmark = pytest.mark.usefixtures("single_thread")

# Three epochs of two digits' classes (9 steps each), a checkpoint and an evaluation after each
# (so model_best.pyth follows each checkpoint), the EMA's state in them, every checkpoint kept
RUN = ["OPTIM.MAX_EPOCH", "3", "TRAIN.CHECKPOINT_PERIOD", "1", "TRAIN.EVAL_PERIOD", "1",
       "TRAIN.KEEP_CHECKPOINTS", "0", "TRAIN.EMA", "True", "TRAIN.BATCH_SIZE", "32",
       "LOG_PERIOD", "2", "DATA.CLASSES", "[0, 1]", "MODEL.NUM_CLASSES", "2"]  # fmt: skip
ASYNC = ["TRAIN.ASYNC_CHECKPOINT", "True"]
# A hook that waits for the loop gives up after this long (a broken loop must not hang the suite)
PATIENCE = 120
WAITING = "waiting for the checkpoint write in flight"


@pytest.fixture(autouse=True)
def no_hooks():
    yield
    async_writes.FAULT_HOOKS.clear()


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The reference: the same run with synchronous checkpoints."""
    out = tmp_path_factory.mktemp("sync")
    trainer.train_model(tiny_quickstart(out, *RUN))
    return out


def _assert_same(ours, ref, where=""):
    """Equal structures, tensors bitwise."""
    if isinstance(ref, torch.Tensor):
        assert torch.equal(ours, ref), where
    elif isinstance(ref, dict):
        assert ours.keys() == ref.keys(), where
        for k in ref:
            _assert_same(ours[k], ref[k], f"{where}/{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref)):
            _assert_same(a, b, f"{where}/{i}")
    else:
        assert ours == ref, where


def _checkpoint(out, epoch, it=0):
    state = checkpoint.load_file(checkpoint.get_checkpoint_path(str(out), epoch, it))
    state.pop("cfg")  # OUT_DIR and TRAIN.ASYNC_CHECKPOINT differ
    return state


class _LogWatch(logging.Handler):
    """Sets ``event`` when a log line holding ``text`` is emitted."""

    def __init__(self, text, event):
        super().__init__()
        self.text, self.event = text, event

    def emit(self, record):
        if self.text in record.getMessage():
            self.event.set()


@pytest.fixture
def log_watch():
    handlers = []

    def watch(text):
        event = threading.Event()
        handlers.append(_LogWatch(text, event))
        logging.getLogger("pycls").addHandler(handlers[-1])  # setup_logging resets the root's
        return event

    yield watch
    for h in handlers:
        logging.getLogger("pycls").removeHandler(h)


def _on(stage, name, action):
    """Runs ``action()`` at ``stage`` of the writes whose path holds ``name``."""

    def hook(path):
        if name in os.path.basename(path):
            action()

    async_writes.FAULT_HOOKS[stage] = hook


def _disk_full():
    raise OSError(errno.ENOSPC, "No space left on device")


def test_async_checkpoints_are_the_sync_ones_written_one_at_a_time(sync_run, tmp_path, log_watch):
    """The epoch-1 write is held after staging until the epoch-2 save waits for it (two epochs
    of training later): the file still holds epoch 1's state, bitwise the synchronous run's, and
    so does every later checkpoint, model_best.pyth and the final weights. Caught: a staging that
    keeps references instead of copies (the file then holds later weights); a save that starts a
    second write beside the first (the hook would never see the loop wait)."""
    waiting = log_watch(WAITING)
    seen = []
    _on("staged", "model_epoch_0001.pyth", lambda: seen.append(waiting.wait(PATIENCE)))
    out = tmp_path / "async"
    trainer.train_model(tiny_quickstart(out, *RUN, *ASYNC))
    assert seen == [True]  # the next save waited for the write in flight
    log = (out / "stdout.log").read_text()
    assert f"for {checkpoint.get_checkpoint_path(str(out), 1)}" in log  # "waited 0.12 s for ..."
    for epoch in (1, 2, 3):
        _assert_same(_checkpoint(out, epoch), _checkpoint(sync_run, epoch), f"epoch {epoch}")
    best = [checkpoint.load_file(checkpoint.get_best_checkpoint_path(str(d)))
            for d in (out, sync_run)]  # fmt: skip
    _assert_same(*[{k: v for k, v in b.items() if k != "cfg"} for b in best], "best")
    assert sorted(os.listdir(out / "checkpoints")) == sorted(os.listdir(sync_run / "checkpoints"))


def test_a_host_copy_is_reused_only_once_no_write_reads_it():
    """The next save copies into the last save's host buffers, but not while a write in flight
    may still read them (model_best.pyth chained onto a checkpoint write not yet done). Caught:
    reuse while a write is in flight (the first copy overwritten); no reuse at all."""
    writer, weights, release = async_writes.Writer(), torch.zeros(4), threading.Event()
    first = writer.stage({"w": weights}, "best")
    writer.submit("in flight", lambda: release.wait(PATIENCE))  # as if writing `first`
    second = writer.stage({"w": weights + 1}, "best")
    assert torch.equal(first["w"], torch.zeros(4)) and torch.equal(second["w"], torch.ones(4))
    release.set()
    assert writer.wait() is None
    third = writer.stage({"w": weights + 2}, "best")  # nothing in flight: into `second`
    assert third["w"].data_ptr() == second["w"].data_ptr() and torch.equal(second["w"], 2 + weights)


@pytest.mark.parametrize(
    "stage, epoch", [("staged", 2), ("mid_write", 2), ("before_rename", 2), ("before_rename", 3)]
)
def test_a_failed_background_write_leaves_nothing_and_the_rerun_resumes_exactly(
    sync_run, tmp_path, stage, epoch
):
    """A full disk at each point of a write in flight: the run stops with the write's one-line
    error at the next wait (the next save; for the last epoch, the end of the run), nothing of
    that checkpoint is visible or left behind, model_best.pyth (chained after it) is not written
    for its epoch, and the rerun resumes to the synchronous run's checkpoints, bitwise. Caught: a
    wait that drops the write's error (the run ends as if all were written; for epoch 3, an end
    of run that does not wait at all)."""
    out = tmp_path / "run"
    resume_from(sync_run, out, 1)
    name = os.path.basename(checkpoint.get_checkpoint_path(str(out), epoch))
    _on(stage, name, _disk_full)
    with pytest.raises(CheckpointWriteError, match=f"{name}.*No space left on device"):
        trainer.train_model(tiny_quickstart(out, *RUN, *ASYNC))
    left = sorted(os.listdir(out / "checkpoints"))
    best = checkpoint.get_best_checkpoint_path(str(out))
    if os.path.exists(best):  # the best so far is of an epoch some checkpoint holds
        assert checkpoint.load_file(best)["epoch"] < epoch
        left.remove(os.path.basename(best))
    assert left == [f"model_epoch_{e:04d}.pyth" for e in range(1, epoch)]  # no *.tmp.*
    async_writes.FAULT_HOOKS.clear()
    trainer.train_model(tiny_quickstart(out, *RUN, *ASYNC))
    assert json_stats_of(out, "resume")[-1]["epoch"] == epoch - 1
    for e in range(epoch, 4):
        _assert_same(_checkpoint(out, e), _checkpoint(sync_run, e), f"epoch {e}")


def test_a_stop_signal_waits_for_the_write_in_flight(sync_run, tmp_path, log_watch):
    """SIGTERM arrives while epoch 1's checkpoint is being written (its write held until epoch 2
    has logged its first steps): the stop checkpoint (mid epoch 2) is written after it, both
    whole, exit status 75, and the resumed run ends at the synchronous run's checkpoint; when
    the stop checkpoint's own write fails, the run says so (CheckpointWriteError, exit 1) instead
    of exiting 75 as if it were written. Caught: a stop that does not wait for its write."""

    def stop_during_the_write():
        epoch_2 = log_watch('"epoch": "2/3"')
        _on("staged", "model_epoch_0001.pyth", lambda: epoch_2.wait(PATIENCE) and os.kill(
            os.getpid(), signal.SIGTERM))  # fmt: skip

    out = tmp_path / "run"
    stop_during_the_write()
    with pytest.raises(dist.Preempted) as stopped:
        trainer.train_model(tiny_quickstart(out, *RUN, *ASYNC))
    assert stopped.value.code == dist.PREEMPTED_EXIT_CODE
    stop = checkpoint.list_checkpoints(str(out))[0]
    assert "_iter_" in stop and checkpoint.load_file(stop)["epoch"] == 1
    _assert_same(_checkpoint(out, 1), _checkpoint(sync_run, 1), "epoch 1")
    async_writes.FAULT_HOOKS.clear()
    trainer.train_model(tiny_quickstart(out, *RUN, *ASYNC))
    _assert_same(_checkpoint(out, 3), _checkpoint(sync_run, 3), "epoch 3")
    failing = tmp_path / "failing"
    stop_during_the_write()
    _on("before_rename", "_iter_", _disk_full)
    with pytest.raises(CheckpointWriteError, match="_iter_.*No space left on device"):
        trainer.train_model(tiny_quickstart(failing, *RUN, *ASYNC))
    left = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(failing))]
    assert left == ["model_epoch_0001.pyth"]


def test_an_error_waits_for_the_write_in_flight(tmp_path, monkeypatch, log_watch):
    """An error in the loop while epoch 1's checkpoint is being written: the run ends with that
    error, after the write has ended (here it fails: its error is logged, its partial file gone,
    no writer thread left). Caught: an error path that does not wait (the write's failure is
    then never seen, the writer thread outlives the run)."""
    raised = threading.Event()
    real_train_epoch = trainer.Trainer.train_epoch

    def train_epoch(self, epoch):
        if epoch == 1:
            raised.set()
            raise RuntimeError("the loop failed")
        return real_train_epoch(self, epoch)

    def fail_late():
        raised.wait(PATIENCE)
        _disk_full()

    monkeypatch.setattr(trainer.Trainer, "train_epoch", train_epoch)
    _on("mid_write", "model_epoch_0001.pyth", fail_late)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the loop failed"):
        trainer.train_model(tiny_quickstart(out, *RUN, *ASYNC))
    assert "the checkpoint write in flight failed too" in (out / "stdout.log").read_text()
    assert os.listdir(out / "checkpoints") == []
    assert not [t for t in threading.enumerate() if t.name == "pycls-checkpoint-writer"]


# ------------------------------------------------------------------------------------------------ #
# DCP folders (FSDP2) in two processes
# ------------------------------------------------------------------------------------------------ #

# (stage, the process whose write fails there): the first two run in every process, the last two
# in rank 0 alone (it seals and renames)
SHARDED_FAULTS = [("staged", 1), ("mid_write", 1), ("before_manifest", 0), ("before_rename", 0)]


def _all_tensors(folder):
    """Every tensor of a DCP folder (model, optimizer, EMA), read by this process alone."""
    reader = files.reader(folder)
    metadata = reader.read_metadata()
    out = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "chunks")
    }
    import torch.distributed.checkpoint as dcp

    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def _train(engine, optimizer, scaler, loss_fn, data, rank):
    for images, labels in data:
        half = images.shape[0] // 2
        mine = slice(rank * half, (rank + 1) * half)
        optimizer.zero_grad(set_to_none=True)
        engine.forward_backward(images[mine], labels[mine], loss_fn, scaler)
        engine.step(optimizer, scaler)


def _sharded_cases(rank, out):
    cfg = {m: tiny_cfg("TRAIN.PARALLEL", "fsdp", "OUT_DIR", os.path.join(out, m), *extra)
           for m, extra in (("sync", []), ("async", ASYNC))}  # fmt: skip
    engine, optimizer, scaler, loss_fn, _ = build(cfg["sync"])
    data = batches(cfg["sync"], 3)
    _train(engine, optimizer, scaler, loss_fn, data[:2], rank)
    runs = {m: RunCheckpoints(c, engine, optimizer, scaler) for m, c in cfg.items()}
    runs["sync"].save(1, 0, {})
    # The async write is held after staging until this process has trained one more step
    trained = threading.Event()
    _on("staged", "model_epoch_0001.tmp", lambda: trained.wait(PATIENCE))
    runs["async"].save(1, 0, {})
    _train(engine, optimizer, scaler, loss_fn, data[2:], rank)
    trained.set()
    runs["async"].wait()
    faults = {}
    for stage, failing in SHARDED_FAULTS:
        async_writes.FAULT_HOOKS.clear()
        if rank == failing:
            _on(stage, "model_epoch_0002.tmp", _disk_full)
        runs["async"].save(2, 0, {})
        try:
            runs["async"].wait()
            faults[stage] = None
        except CheckpointWriteError as e:
            faults[stage] = str(e)
        dist.barrier()
        faults[stage, "left"] = sorted(os.listdir(os.path.join(out, "async", "checkpoints")))
    async_writes.FAULT_HOOKS.clear()
    return {"faults": faults}


def _sharded_worker(rank, world, port, out):
    init_gloo(rank, world, port)
    try:
        result = _sharded_cases(rank, out)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_sharded(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sharded2"))
    spawn(_sharded_worker, 2, out)
    return out, [torch.load(os.path.join(out, f"rank{r}.pt")) for r in (0, 1)]


def test_an_async_dcp_folder_is_the_sync_one(two_sharded):
    """Two FSDP2 processes, the async write held after staging while both train another step:
    the folder holds the state of the save, bitwise the synchronous folder's (every tensor, each
    process's RNG, the train state), and verifies against its manifest. Caught: a staging that
    keeps references (DCP's own stager is used: this holds it to its word)."""
    out, _ = two_sharded
    sync, asyn = (checkpoint.get_checkpoint_path(os.path.join(out, m), 1, sharded=True)
                  for m in ("sync", "async"))  # fmt: skip
    assert files.verify(asyn)
    _assert_same(_all_tensors(asyn), _all_tensors(sync), "tensors")
    for name in (sharded.TRAIN_STATE, *(sharded.RNG_STATE.format(r) for r in (0, 1))):
        ours, ref = (checkpoint.load_file(os.path.join(f, name)) for f in (asyn, sync))
        ours.pop("cfg", None), ref.pop("cfg", None)
        _assert_same(ours, ref, name)


@pytest.mark.parametrize("stage, failing", SHARDED_FAULTS)
def test_a_dcp_write_failing_in_one_process_fails_in_both_and_leaves_nothing(
    two_sharded, stage, failing
):
    """A full disk in one process at each point of an async DCP write: both processes raise the
    write error at their wait (the one that failed with its cause), the epoch-2 folder is neither
    visible nor left as a temporary, and the epoch-1 folder still verifies. Caught: a wait that
    does not agree across processes (the healthy one would go on), a folder sealed or renamed
    without every part, a partial folder left behind."""
    out, results = two_sharded
    for rank in (0, 1):
        error = results[rank]["faults"][stage]
        assert error is not None, (stage, rank)
        if rank == failing:
            assert "No space left on device" in error
        assert results[rank]["faults"][stage, "left"] == ["model_epoch_0001"]
    assert files.verify(checkpoint.get_checkpoint_path(os.path.join(out, "async"), 1, sharded=True))


# ------------------------------------------------------------------------------------------------ #
# The stall, at ViT-B/16's size
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.slow
def test_an_async_save_holds_the_loop_a_fraction_of_a_sync_one(tmp_path):
    """ViT-B/16 with AdamW (1.04 GB of checkpoint), saved as one file through the trainer's own
    RunCheckpoints, synchronous and asynchronous rounds alternating in this process: the loop's
    CPU seconds in an async save are under half a sync save's (the copy against the checksum,
    serialisation and write), and its wall seconds under a sync save's. The best of two rounds
    each, so a busy machine slows both. Caught: a save that writes in the loop's thread."""
    stall = load_tool("checkpoint_stall", folder="benchmarks")
    r = stall.measure("vit_b16", str(tmp_path), rounds=2, layouts=("file",))["file"]
    sync_cpu, async_cpu = min(r["sync"]["stall_cpu"]), min(r["async"]["stall_cpu"])
    sync_wall, async_wall = min(r["sync"]["stall"]), min(r["async"]["stall"])
    print(f"stall: sync {sync_wall:.2f} s ({sync_cpu:.2f} CPU s), async {async_wall:.2f} s "
          f"({async_cpu:.2f} CPU s), {r['bytes'] / 1e9:.2f} GB, load "
          f"{os.getloadavg()}")  # fmt: skip
    assert r["bytes"] > 1e9
    assert async_cpu < 0.5 * sync_cpu
    assert async_wall < sync_wall
