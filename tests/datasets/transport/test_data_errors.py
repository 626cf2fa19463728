"""Data that cannot be read, as the command line reports it: one line naming the path or URL and
what the server or the operating system answered, with the exit status of docs/trust.md's table
(2: the path is the user's to fix; 1: the machine failed). Every server is a tiny one on
127.0.0.1 in a thread of this process; a refused connection is a port nothing listens on."""

import contextlib
import io

import pytest

from pycls.core import cli
from pycls.datasets.formats.synthetic import Synthetic
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.datasets.transport import read_attempts
from tests.helpers import QUICKSTART, TINY
from tests.helpers.data_servers import RangeHandler, Server, closed_port


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two tar shards of 4 tiny images each, in wds/ (and a folder the server refuses)."""
    root = tmp_path_factory.mktemp("errors")
    write_webdataset(Synthetic(8, 8, 2), root / "wds", split="train", shard_size=4)
    (root / "secret").mkdir()
    return root


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(read_attempts, "RETRY_PAUSE", 0.01)


def _run(tmp_path, *data):
    """(exit status, the one line on stderr) of a training run over ``data``'s keys."""
    args = ["--mode", "train", "--cfg", QUICKSTART, *TINY, "OPTIM.MAX_EPOCH", "1",
            "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
            "DATA_LOADER.RETRIES", "2", "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix"),
            "DATA_LOADER.READ_TIMEOUT", "0.5",
            "OUT_DIR", str(tmp_path / "out"), *data]  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(args)
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    return status, lines[0]


def _pattern(base):
    return ["DATA.PATH", f"{base}train-{{000000..000001}}.tar", "DATA.TEST_PATH",
            f"{base}train-000000.tar"]  # fmt: skip


def test_a_missing_local_shard_of_a_pattern_is_the_users(shards, tmp_path):
    status, line = _run(tmp_path, "DATA.PATH", str(shards / "wds" / "train-{000000..000003}.tar"),
                        "DATA.TEST_PATH", str(shards / "wds" / "train-000000.tar"))  # fmt: skip
    assert status == 2, line
    assert f"{shards / 'wds' / 'train-000002.tar'} (and 1 more of the 4)" in line
    assert "does not exist" in line and line.startswith("config error: DATA.PATH")


@pytest.mark.parametrize("how", ["pattern", "folder"])
def test_a_url_the_server_does_not_have_is_the_users(shards, tmp_path, how):
    with Server(shards) as server:
        base = server.url("nowhere/")
        status, line = _run(tmp_path, *(_pattern(base) if how == "pattern" else
                                        ["DATA.PATH", base]))  # fmt: skip
    assert status == 2, line
    assert "127.0.0.1" in line and "/nowhere/" in line and "HTTP 404 Not Found" in line


def test_a_server_that_refuses_access_is_the_users_and_says_where_a_token_goes(shards, tmp_path):
    with Server(shards, script=[403] * 20, scripted="secret/") as server:
        status, line = _run(tmp_path, "DATA.PATH", server.url("secret/"))
    assert status == 2, line
    assert server.url("secret/") in line and "HTTP 403 Forbidden" in line
    assert "DATA_LOADER.STORAGE_OPTIONS" in line


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/wds/", "http:///wds/"])
def test_a_malformed_url_is_the_users(shards, tmp_path, url):
    status, line = _run(tmp_path, "DATA.PATH", url)
    assert status == 2, line
    assert url in line and "is not a valid URL" in line


@pytest.mark.parametrize("how", ["pattern", "folder"])
def test_a_refused_connection_is_the_machines(shards, tmp_path, how):
    base = f"http://127.0.0.1:{closed_port()}/wds/"
    status, line = _run(tmp_path, *(_pattern(base) if how == "pattern" else ["DATA.PATH", base]))
    assert status == 1, line
    assert base in line and "connection refused: nothing listens on 127.0.0.1" in line
    assert "after 2 attempts" in line and "not found" not in line


def test_a_server_that_stays_silent_times_out_as_the_machines(shards, tmp_path):
    with Server(shards, script=["stall"] * 4, scripted="wds/") as server:
        status, line = _run(tmp_path, "DATA.PATH", server.url("wds/"))
    assert status == 1, line
    assert server.url("wds/") in line and "timed out" in line and "after 2 attempts" in line


def test_a_server_error_after_every_attempt_is_the_machines(shards, tmp_path):
    with Server(shards, RangeHandler, script=[503] * 4, scripted=".tar") as server:
        status, line = _run(tmp_path, *_pattern(server.url("wds/")))
    assert status == 1, line
    assert server.url("wds/train-000000.tar") in line and "HTTP 503" in line
    assert "after 2 attempts" in line
