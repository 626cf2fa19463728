"""The one retry policy of every read from a URL: ranges, whole files, streams, listings and
sizes, over http(s) and fsspec alike.

``attempt`` tries a read up to ``retries`` times, each try under a watch of its deadline
(``pycls.datasets.transport.read_deadlines``: a window without its floor rate, silent or trickling,
fails it). Each failure that may pass (a refused or dropped connection, a 5xx, 408, 425 or 429
answer, a short answer, an attempt below the floor) is logged with the URL, the attempt and the
pause (doubling from RETRY_PAUSE, at most MAX_RETRY_PAUSE: ``retry_pause``), then tried again; a
404, 403 or malformed URL is the user's at once (``DataPathError``); the machine's after the last
attempt (``DataReadError``); a stop signal ends an attempt or a pause (``WaitStopped``).
``classify`` says whose a failure is and what happened, in words that never quote another library's
exception where it may hold a request header; every message passes through
``read_errors.without_secrets``.
"""

import http.client
import logging
import socket
import ssl
import time
from urllib.parse import urlsplit

from pycls.datasets.transport import read_deadlines
from pycls.datasets.transport.read_errors import (
    DataChangedError,
    DataPathError,
    DataReadError,
    HTTPStatusError,
    ShortAnswer,
    without_secrets,
)
from pycls.errors import WaitStopped

logger = logging.getLogger(__name__)

# Pause before the second attempt of a failed read; it doubles each time, up to MAX_RETRY_PAUSE
RETRY_PAUSE = 0.2
# The longest pause between two attempts: a server back after an hour's outage is read again
# within a minute, and many attempts wait in proportion to their number, not exponentially
MAX_RETRY_PAUSE = 60.0
# Answers that may pass: asked again (the others of 4xx are the request's, not the moment's)
_RETRIED_STATUS = (408, 425, 429)


def _server_of(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.hostname or parts.netloc}:{port or default}" if default else parts.netloc


def classify(err: BaseException, url: str, timeout: float | None = None) -> tuple[bool, str]:
    """(whether the user fixes it, what happened in words) of a failed read of ``url``: a
    missing file, a refusal, a malformed URL are the user's; the rest the machine's.
    ``timeout``: the window the attempt had (the default where not given)."""
    if isinstance(err, DataPathError):
        return True, str(err)
    if isinstance(err, HTTPStatusError):
        status = err.status
        if status in (404, 410):
            return True, f"the server answered {err} (no such file)"
        if status in (401, 403):
            return True, (
                f"the server answered {err}: it refuses access (a private server takes its token "
                "from DATA_LOADER.STORAGE_OPTIONS, docs/data_formats.md)"
            )
        if status < 500 and status not in _RETRIED_STATUS:
            return True, f"the server answered {err}"
        return False, f"the server answered {err}"
    if isinstance(err, FileNotFoundError):  # fsspec's file systems say a file is missing so
        return True, f"no such file ({' '.join(str(err).split())})"
    if isinstance(err, PermissionError):
        return True, f"access refused ({' '.join(str(err).split())})"
    server = _server_of(url)
    if isinstance(err, ConnectionRefusedError):
        return False, f"connection refused: nothing listens on {server}"
    if isinstance(err, socket.gaierror):
        return True, f"the host name of {server} does not resolve ({err.strerror or err})"
    if isinstance(err, TimeoutError | socket.timeout):
        seconds = timeout or read_deadlines.READ_TIMEOUT
        return False, f"no answer from {server} for {seconds:g} s (timed out)"
    if isinstance(err, ShortAnswer):
        return False, str(err)
    if isinstance(err, http.client.IncompleteRead):
        return False, f"the connection dropped mid-answer ({len(err.partial)} bytes came)"
    if isinstance(err, ssl.SSLError):
        return False, f"TLS with {server} failed ({' '.join(str(err).split())})"
    if isinstance(err, ValueError | UnicodeError):  # a request http.client would not send
        return True, (
            f"the request could not be sent ({type(err).__name__}; its text is not shown: it "
            "may quote a header of DATA_LOADER.STORAGE_OPTIONS)"
        )
    return False, f"{type(err).__name__}: {' '.join(str(err).split())}"


def retry_pause(failed: int) -> float:
    """Seconds to wait after attempt number ``failed`` (1, 2, ...) failed: RETRY_PAUSE, doubling,
    at most MAX_RETRY_PAUSE."""
    if failed > 64:  # 2 ** 64 * RETRY_PAUSE is past any cap: spare the float
        return MAX_RETRY_PAUSE
    return min(RETRY_PAUSE * 2.0 ** (failed - 1), MAX_RETRY_PAUSE)


def total_pause(attempts: int) -> float:
    """Seconds of pauses between ``attempts`` attempts that all fail (``retry_pause`` after each
    but the last)."""
    total, failed = 0.0, 1
    while failed < attempts and retry_pause(failed) < MAX_RETRY_PAUSE:
        total += retry_pause(failed)
        failed += 1
    return total + max(0, attempts - failed) * MAX_RETRY_PAUSE


def attempt(read, what: str, url: str, retries: int, state: dict | None = None):
    """``read()``, tried up to ``retries`` times, each try under a watch of its deadline
    (``read_deadlines``); each failure that may pass is logged (URL, attempt, pause) and tried
    again. Raises DataPathError (the user's) or DataReadError, and WaitStopped when a stop
    signal ends an attempt or a pause. ``state["attempt"]`` says which attempt runs (for a
    caller that reports a stall)."""
    retries = max(1, retries)
    for number in range(1, retries + 1):
        if state is not None:
            state["attempt"], state["since"] = number, time.monotonic()
        result, failure = _try(read, what, url)
        if failure is None:
            return result
        users, words = failure[0], without_secrets(failure[1])
        if users:
            raise DataPathError(f"cannot read {what}: {words}") from None
        if number == retries:
            tries = f"after {retries} attempts" if retries > 1 else "(one attempt)"
            raise DataReadError(f"cannot read {what} {tries}: {words}") from None
        pause = retry_pause(number)
        logger.warning(
            f"reading {what} failed (attempt {number} of {retries}: {words}); trying again in "
            f"{pause:.2g} s"
        )
        read_deadlines.pause(pause, what)
    raise AssertionError("unreachable")


def _try(read, what: str, url: str):
    """(what ``read()`` returned, None), or (None, (whether the user fixes it, the failure in
    words)) when it failed or was cut."""
    with read_deadlines.watching() as watch:
        try:
            result, error = read(), None
        except (DataReadError, DataPathError, DataChangedError, WaitStopped):
            raise  # it names the URL already; a changed file does not change back
        except Exception as err:  # noqa: BLE001 (http.client's, fsspec's, aiohttp's, botocore's)
            result, error = None, err
    if watch.cut is not None and watch.links:  # what came may be cut short: never used
        if watch.cut == "stop":
            raise read_deadlines.stopped(what)
        return None, (False, watch.words())
    if error is None:
        return result, None
    return None, classify(error, url, watch.window)
