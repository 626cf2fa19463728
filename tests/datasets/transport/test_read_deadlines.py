"""Every read from a URL has a deadline and a floor, and a stop signal ends a wait for one within
seconds (pycls.datasets.transport.read_deadlines). The servers are tiny ones on 127.0.0.1 in threads
of this process that trickle: half an answer at once, then a byte every 0.2 s (the report's server
sent a byte a second: a run waited past 420 s at indexing and again mid-epoch, and SIGTERM did not
end it). The runs that are signalled run in warm processes (tests/helpers/warm.py); the time limits
catch a hang (the trickle outlasts them many times over), scaled with the load."""

import contextlib
import io
import os
import signal
import sys
import time

import pytest
from safetensors.torch import load_file

from pycls import distributed as dist
from pycls import signals
from pycls.checkpoint import single_file, weight_files
from pycls.core import cli, evaluation, trainer
from pycls.datasets.formats.synthetic import Synthetic
from pycls.datasets.formats.tar_index import IndexCache
from pycls.datasets.formats.tar_shards import TarShards
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.datasets.transport import read_attempts, remote_files
from pycls.errors import WaitStopped
from tests.helpers import QUICKSTART, RUN_NET, TINY, busy_factor, tiny_quickstart, warm, within
from tests.helpers.data_servers import Server

# How busy the machine is: a limit that catches a hang grows with it
LOAD = busy_factor()
# The longest a stopped run may take to end (3 s of grace and the exit take ~5 s on an idle
# machine): the trickles last ten times as long, so a run that waits them out fails
STOP_LIMIT = 45 * LOAD
TRICKLE_FOR = 10 * STOP_LIMIT


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """48 training images in 3 tar shards and 8 to evaluate, 8 px, 2 classes."""
    root = tmp_path_factory.mktemp("deadlines")
    write_webdataset(Synthetic(48, 8, 2, seed=0), root / "wds", split="train", shard_size=16)
    write_webdataset(Synthetic(8, 8, 2, seed=1), root / "wds", split="val", shard_size=8)
    return root


def _args(url, out, *keys):
    """A one-epoch run of 6 steps over the shards at ``url``, read by ranges, each batch one
    range of one shard (the shards in random order, their samples in turn), never stopping at a
    log boundary (LOG_PERIOD past the epoch): a stop can only end a wait."""
    return ["--mode", "train", "--cfg", QUICKSTART, *TINY, "DATA.PATH", url,
            "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
            "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "8", "OPTIM.MAX_EPOCH", "1",
            "LOG_PERIOD", "100", "DATA_LOADER.READAHEAD_MB", "0", "DATA_LOADER.SHUFFLE_BUFFER", "1",
            "DATA_LOADER.INDEX_CACHE", f"{out}-ix", "OUT_DIR", str(out), *keys]  # fmt: skip


def _stream_of(name):
    """Picks the requests that stream shard ``name`` (to index it): GETs of the whole file, or
    of the rest of it from where a dropped stream broke."""

    def streams(path, handler):
        asked = handler.headers.get("Range", "")
        return path.endswith(name) and handler.command == "GET" and asked[-1:] in ("", "-")

    return streams


def _nth_training_range(n):
    """Picks the n-th request of a byte range of a training shard (a batch's read), counted from
    the first (the one-byte probe of whether the server serves ranges is not one)."""
    seen = []

    def picks(path, handler):
        asked = handler.headers.get("Range", "")
        if "/train-" not in path or not asked or asked == "bytes=0-0" or asked.endswith("-"):
            return False
        seen.append(path)
        return len(seen) == n

    return picks


def _cli(args):
    """(exit status, the one line on stderr) of a run in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(args)
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    return status, lines[0]


def test_a_server_that_trickles_fails_each_attempt_and_the_run_stops_naming_url_and_rate(
    shards, tmp_path, monkeypatch
):
    """The floor: the stream that indexes a shard trickles (half of it at once, then 5 bytes a
    second) at every attempt; each attempt fails after its window (1 s here), and after the
    second the run stops in one line naming the URL and the rate seen, exit 1. Before, the 60 s
    limit was per socket read, which a byte every 0.2 s never reaches: the run waited for the
    whole trickle."""
    monkeypatch.setattr(read_attempts, "RETRY_PAUSE", 0.01)
    with Server(shards, script=["trickle"] * 10) as server:
        server.picks, server.trickle_for = _stream_of("train-000000.tar"), TRICKLE_FOR
        began = time.monotonic()
        status, line = _cli(_args(server.url("wds/"), tmp_path / "out", "DATA_LOADER.RETRIES", "2",
                                  "DATA_LOADER.READ_TIMEOUT", "1",
                                  "DATA_LOADER.MIN_READ_RATE_KB", "1"))  # fmt: skip
        took = time.monotonic() - began
    assert status == 1, line
    assert line.startswith(f"error: cannot read {server.url('wds/train-000000.tar')} after 2 "
                           "attempts: 127.0.0.1:")  # fmt: skip
    assert "bytes/s), below the floor of 1 KiB/s over 1 s" in line
    assert "DATA_LOADER.MIN_READ_RATE_KB" in line and took < STOP_LIMIT


def test_an_attempt_below_the_floor_is_tried_again_and_the_log_names_the_rate(
    shards, tmp_path, caplog, monkeypatch
):
    """A range that trickles once is read again, the failure logged with the URL, the attempt
    and the rate seen; the samples are the local ones. Before, the trickle was waited out."""
    monkeypatch.setattr(read_attempts, "RETRY_PAUSE", 0.01)
    local = TarShards(sorted(str(p) for p in (shards / "wds").glob("train-*.tar")),
                      cache_dir=tmp_path / "ix-local")  # fmt: skip
    with Server(shards) as server:
        url = server.url("wds/train-000001.tar")
        tars = TarShards([url], cache_dir=tmp_path / "ix", access=remote_files.Access(
            read_timeout=1.0, min_rate=1024))  # fmt: skip
        server.script, server.picks = ["trickle"], _nth_training_range(1)
        server.trickle_for = TRICKLE_FOR
        got = within(STOP_LIMIT, lambda: tars.load_many([1, 2, 3]))
    assert not isinstance(got, BaseException), got
    assert all((g[0] == local[16 + i][0]).all() for g, i in zip(got, (1, 2, 3)))
    failed = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(failed) == 1 and url in failed[0] and "attempt 1 of 3: 127.0.0.1:" in failed[0]
    assert "bytes/s), below the floor of 1 KiB/s" in failed[0]


def _signal_when_trickling(server, run, sig):
    """Sends ``sig`` to the run once the server trickles; (exit status, stdout, stderr) of the
    run, the status None when it outlived STOP_LIMIT after the signal (it is then killed)."""
    if not server.trickling.wait(STOP_LIMIT):
        status, out, err = run.wait(1)
        pytest.fail(f"the server never trickled (exit {status}): {err[-2000:]}")
    os.kill(run.pid, sig)
    return run.wait(STOP_LIMIT)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_stop_ends_an_index_build_that_waits_on_a_trickle(shards, tmp_path, sig, code):
    """Indexing (before training): the stop ends the wait within seconds, in one line with the
    stop's status; nothing was trained, no checkpoint is written, nothing of the shard indexed in
    part is cached. Before, the run went on waiting for the trickle and ignored SIGTERM."""
    out = tmp_path / "out"
    with Server(shards, script=["trickle"] * 10) as server:
        server.picks, server.trickle_for = _stream_of("train-000000.tar"), TRICKLE_FOR
        run = warm.start([sys.executable, RUN_NET, *_args(server.url("wds/"), out)])
        status, _, stderr = _signal_when_trickling(server, run, sig)
    assert status == code, stderr[-3000:]
    name = "SIGTERM" if sig == signal.SIGTERM else "Ctrl-C"
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"stopped: {name} ended the wait for "), line
    assert line.endswith(server.url("wds/train-000000.tar")), line
    assert not list(out.glob("checkpoints/*"))
    assert not IndexCache(f"{out}-ix")._path(server.url("wds/train-000000.tar")).exists()


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """The final weights of the run uninterrupted, over the same server and shards."""
    out = tmp_path_factory.mktemp("reference") / "out"
    with Server(shards) as server:
        status, _, err = warm.start([sys.executable, RUN_NET, *_args(server.url("wds/"), out),
                                     "DATA_LOADER.NUM_WORKERS", "0"]).wait(600 * LOAD)  # fmt: skip
    assert status == 0, err[-3000:]
    return load_file(weight_files.final_weights_path(str(out)))


@pytest.mark.parametrize("workers", [0, 1], ids=["main-process", "loader-worker"])
def test_a_stop_mid_epoch_ends_the_wait_on_a_trickle_with_a_checkpoint_and_the_resume_is_exact(
    shards, tmp_path, reference, workers
):
    """Mid-epoch, the read of a batch trickles (in the training process itself, or in its loader
    worker, which ignores the signal and follows its main process's stop): SIGTERM ends the wait
    within seconds, the checkpoint of the last step trained is written and the run exits 75;
    resumed over a healthy server it ends with the uninterrupted run's weights, bit for bit.
    Before, the run waited for the trickle (LOG_PERIOD is past the epoch here: no step boundary
    it stops at comes before the batch it waits for)."""
    out = tmp_path / "out"
    keys = ["DATA_LOADER.NUM_WORKERS", str(workers)]
    with Server(shards, script=["trickle"]) as server:
        server.picks, server.trickle_for = _nth_training_range(3), TRICKLE_FOR
        run = warm.start([sys.executable, RUN_NET, *_args(server.url("wds/"), out, *keys)])
        status, _, stderr = _signal_when_trickling(server, run, signal.SIGTERM)
        assert status == 75, stderr[-3000:]
        log = (out / "stdout.log").read_text()
        assert "stopping on a preemption signal after epoch 0 + " in log, log[-3000:]
        assert "stopping on a preemption signal after epoch 0 + 2 steps" in log, log[-3000:]
        resumed = warm.start([sys.executable, RUN_NET, *_args(server.url("wds/"), out, *keys)])
        status, _, stderr = resumed.wait(600 * LOAD)
    assert status == 0, stderr[-3000:]
    final = load_file(weight_files.final_weights_path(str(out)))
    assert final.keys() == reference.keys()
    assert all((final[k] == reference[k]).all() for k in final)


_HELD_READ = """
import sys, time
from pycls import distributed as dist
from pycls.datasets.transport import read_deadlines, remote_files
read_deadlines.STOP_GRACE = 600  # the wait outlasts the test: only a second SIGTERM ends it
flag = dist.PreemptionFlag().install()
print("reading", flush=True)
remote_files.RangeReader(1).read(sys.argv[1], 0, 4000)
print("read it", flush=True)
"""


def test_a_second_sigterm_ends_the_process_and_a_duplicate_does_not(shards, tmp_path):
    """A stop delivered twice at once (a process group's signal and a parent passing it on) is
    one stop; a second SIGTERM a second or more later ends a process that waits on a read at
    once, as a second Ctrl-C does (its grace after the first is made longer than the test here).
    Before, every SIGTERM only set the stop flag and the read went on."""
    with Server(shards, script=["trickle"]) as server:
        server.scripted, server.trickle_for = "train-000000.tar", TRICKLE_FOR
        run = warm.start([sys.executable, "-c", _HELD_READ, server.url("wds/train-000000.tar")])
        assert server.trickling.wait(STOP_LIMIT)
        os.kill(run.pid, signal.SIGTERM)
        os.kill(run.pid, signal.SIGTERM)  # the same stop again, at once
        time.sleep(signals.REPEAT_AFTER + 0.2)
        assert run.process.is_alive()
        os.kill(run.pid, signal.SIGTERM)
        status, out, err = run.wait(STOP_LIMIT)
    assert status == -signal.SIGTERM, (status, err[-2000:])
    assert "reading" in out and "read it" not in out


def test_a_stop_that_ends_an_evaluations_wait_writes_the_epochs_checkpoint(tmp_path, monkeypatch):
    """The evaluation after an epoch waits for data a stop ends: the epoch's checkpoint is
    written (that evaluation is not run) and the run exits 75, nothing trained lost. Before, no
    wait ended on a stop; a stop that had ended it there would have lost the epoch."""

    def waits(*args, **kwargs):
        signals.note_stop(signal.SIGTERM)
        raise WaitStopped("SIGTERM ended the wait for http://127.0.0.1:9/val-000000.tar")

    monkeypatch.setattr(evaluation.Evaluator, "run", waits)
    cfg = tiny_quickstart(tmp_path, "OPTIM.MAX_EPOCH", "2", "TRAIN.EVAL_PERIOD", "1",
                          "TRAIN.BATCH_SIZE", "256")  # fmt: skip
    with pytest.raises(dist.Preempted) as err:
        trainer.train_model(cfg)
    assert err.value.code == 75
    assert os.path.exists(single_file.get_checkpoint_path(str(tmp_path), 1))
    assert "stopping on a preemption signal after epoch 1 + 0 steps" in (
        tmp_path / "stdout.log").read_text()  # fmt: skip
