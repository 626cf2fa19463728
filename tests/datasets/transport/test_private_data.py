"""Data on a private server: the token goes in DATA_LOADER.STORAGE_OPTIONS as a reference to an
environment variable (``${VAR}``), is sent with every request to that server, and is never
written: not in config.yaml, the log or a message. A token written out in the config is refused
naming the key, without showing it; a variable whose value no HTTP header may carry (a CR left by
a .env file with Windows line ends, a character outside Latin-1) is refused where it is read,
naming the variable, and its value reaches no file a failed run writes."""

import contextlib
import io
import json

import pytest

from pycls import config
from pycls.core import cli
from pycls.datasets.formats.synthetic import Synthetic
from pycls.datasets.formats.tar_writer import write_webdataset
from pycls.datasets.transport import read_attempts
from pycls.datasets.transport.read_errors import hide, without_secrets
from tests.helpers import QUICKSTART, TINY
from tests.helpers.data_servers import RangeHandler, Server

TOKEN = "s3cr3t-t0ken-for-the-test"
OPTIONS = '{"headers": {"Authorization": "Bearer ${PYCLS_TEST_TOKEN}"}}'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("private")
    for split, seed in (("train", 0), ("val", 1)):
        write_webdataset(Synthetic(8, 8, 2, seed=seed), root / "wds", split=split, shard_size=4)
    return root


def _train(tmp_path, url, *keys):
    args = ["--mode", "train", "--cfg", QUICKSTART, *TINY, "DATA.PATH", url,
            "MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
            "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1",
            "DATA_LOADER.INDEX_CACHE", str(tmp_path / "ix"), "OUT_DIR", str(tmp_path / "out"),
            *keys]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = cli.main(args)
    return status, out.getvalue() + err.getvalue()


def test_a_token_from_the_environment_reads_a_private_server_and_is_never_written(
    served, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYCLS_TEST_TOKEN", TOKEN)
    with Server(served, RangeHandler) as server:
        server.token = TOKEN
        status, printed = _train(tmp_path, server.url("wds/"), "DATA_LOADER.STORAGE_OPTIONS",
                                 OPTIONS)  # fmt: skip
        assert status == 0, printed[-2000:]
        refused, line = _train(tmp_path / "without", server.url("wds/"))
    assert refused == 2 and "HTTP 403 Forbidden" in line and "STORAGE_OPTIONS" in line
    written = [printed] + [p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*")
                           if p.is_file() and p.suffix in (".yaml", ".log", ".txt")]  # fmt: skip
    assert all(TOKEN not in text for text in written)
    assert "${PYCLS_TEST_TOKEN}" in (tmp_path / "out" / "config.yaml").read_text()


def test_a_variable_that_is_not_set_is_named(served, tmp_path, monkeypatch):
    monkeypatch.delenv("PYCLS_TEST_TOKEN", raising=False)
    with Server(served, RangeHandler) as server:
        status, printed = _train(tmp_path, server.url("wds/"), "DATA_LOADER.STORAGE_OPTIONS",
                                 OPTIONS)  # fmt: skip
    assert status == 2
    assert "the environment variable PYCLS_TEST_TOKEN is not set" in printed


WRITTEN_OUT = [{"headers": {"Authorization": f"Bearer {TOKEN}"}}, {"token": TOKEN}]


@pytest.mark.parametrize("options", [json.dumps(o) for o in WRITTEN_OUT])
def test_a_token_written_out_is_refused_without_showing_it(options):
    with pytest.raises(config.ConfigError) as err:
        config.load_cfg(QUICKSTART, ["DATA_LOADER.STORAGE_OPTIONS", options])
    line = str(err.value)
    assert line.startswith("DATA_LOADER.STORAGE_OPTIONS: ") and "${VAR}" in line
    assert TOKEN not in line


def test_a_config_file_may_write_the_options_as_a_mapping(tmp_path):
    path = tmp_path / "private.yaml"
    path.write_text(
        "DATA_LOADER:\n  STORAGE_OPTIONS:\n    headers:\n"
        '      Authorization: "Bearer ${PYCLS_TEST_TOKEN}"\n'
    )
    cfg = config.load_cfg(str(path), ["OUT_DIR", str(tmp_path / "o")])
    assert json.loads(cfg.DATA_LOADER.STORAGE_OPTIONS) == json.loads(OPTIONS)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(cfg.dump())
    again = config.load_cfg(str(dumped), ["OUT_DIR", str(tmp_path / "o")])
    assert again.DATA_LOADER.STORAGE_OPTIONS == cfg.DATA_LOADER.STORAGE_OPTIONS


@pytest.mark.parametrize(
    "value, problem",
    [(f"{TOKEN}\r", "holds a carriage return (CR) at its end"),
     (f"{TOKEN}\u2019", "holds a character HTTP headers cannot carry (U+2019")],
    ids=["crlf-env-file", "not-latin-1"],
)  # fmt: skip
def test_a_token_no_header_may_carry_is_refused_naming_its_variable_never_its_value(
    served, tmp_path, monkeypatch, value, problem
):
    """Checked once where ${VAR} is read: exit 2 in one line naming the variable, no request
    sent. Every file the failed run wrote (OUT_DIR, whatever its name) and all it printed are
    searched for the token. Before, each request failed in http.client, whose ValueError quoted
    the header: the log had the token twice and the last line once, after three attempts, exit 1."""
    monkeypatch.setenv("PYCLS_TEST_TOKEN", value)
    with Server(served, RangeHandler) as server:
        server.token = TOKEN
        status, printed = _train(tmp_path, server.url("wds/"), "DATA_LOADER.STORAGE_OPTIONS",
                                 OPTIONS)  # fmt: skip
        asked = dict(server.requests)
    line = printed.strip().splitlines()[-1]
    assert status == 2, printed[-2000:]
    assert line.startswith("config error: DATA_LOADER.STORAGE_OPTIONS: header Authorization: the "
                           f"environment variable PYCLS_TEST_TOKEN {problem}")  # fmt: skip
    assert not asked
    written = [printed.encode()] + [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    assert all(TOKEN.encode() not in data for data in written)
    assert all(value.encode("utf-8", "replace") not in data for data in written)


def test_no_exception_text_that_may_quote_a_header_reaches_a_message(monkeypatch):
    """http.client quotes a header it will not send (ValueError) or cannot encode; such text is
    never a message's, and a value read from the environment for a URL reads as its ${VAR}."""
    hide(f"Bearer {TOKEN}", "PYCLS_TEST_HEADER")
    quoting = ValueError(f"Invalid header value b'Bearer {TOKEN}\\r'")
    users, words = read_attempts.classify(quoting, "http://127.0.0.1:9/x")
    assert users and TOKEN not in words and "ValueError" in words
    assert without_secrets(f"got Bearer {TOKEN} back") == "got ${PYCLS_TEST_HEADER} back"
    monkeypatch.setattr(read_attempts, "RETRY_PAUSE", 0.0)

    def fails():
        raise OSError(f"the proxy said: Bearer {TOKEN}")

    with pytest.raises(OSError) as err:
        read_attempts.attempt(fails, "x", "http://127.0.0.1:9/x", 2)
    assert TOKEN not in str(err.value) and "${PYCLS_TEST_HEADER}" in str(err.value)
