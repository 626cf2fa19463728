"""What the settings of a read from a URL may be, and the Access they make where the data is read
(the config's checks and the builders both ask here; the keys are DATA_LOADER's):

- a read that keeps failing reports within a day: its attempts (RETRIES) each wait up to
  READ_TIMEOUT for a silent server, with pauses doubling from ``RETRY_PAUSE`` up to
  ``MAX_RETRY_PAUSE`` between them (``read_wait_s``, ``max_retries``);
- STORAGE_OPTIONS is a JSON object whose headers are text and whose secrets are written as
  ``${VAR}`` (``storage_options_problem``), since config.yaml, the log and every checkpoint record
  the key as written; a value is never shown in a message;
- ``read_access``: the ``Access`` of those settings, each ``${VAR}`` taken from this process's
  environment: a variable that is not set, or whose value no HTTP header may carry, is refused
  there, naming it (never its value), as a mistake of the config.

Plain Python, no torch: a config's checks run before torch loads.
"""

import functools
import json
import re

from pycls.datasets.transport import read_attempts, read_deadlines, url_access
from pycls.datasets.transport.read_errors import DataPathError
from pycls.errors import ConfigError

# The longest a read that fails every attempt may take before the run says so
MAX_READ_WAIT_S = 24 * 3600
_READ_TIMEOUT = read_deadlines.READ_TIMEOUT
RETRY_PAUSE, MAX_RETRY_PAUSE = read_attempts.RETRY_PAUSE, read_attempts.MAX_RETRY_PAUSE


def read_wait_s(attempts, read_timeout=_READ_TIMEOUT):
    """Seconds a read that fails every one of ``attempts`` takes before the run reports it:
    each attempt may wait ``read_timeout`` (DATA_LOADER.READ_TIMEOUT) for a silent server, and
    the pauses between attempts start at RETRY_PAUSE and double up to MAX_RETRY_PAUSE
    (pycls.datasets.transport.read_attempts)."""
    return attempts * read_timeout + read_attempts.total_pause(attempts)


def max_retries(read_timeout=_READ_TIMEOUT):
    """The most attempts whose failing read still reports within MAX_READ_WAIT_S."""
    return _max_retries(float(read_timeout), RETRY_PAUSE, MAX_RETRY_PAUSE, MAX_READ_WAIT_S)


@functools.lru_cache(maxsize=8)
def _max_retries(read_timeout, retry_pause, max_retry_pause, max_wait_s):
    """max_retries for these settings (every config check asks: counted once, ~10 ms each)."""
    most = 1
    while read_wait_s(most + 1, read_timeout) <= max_wait_s:
        most += 1
    return most


# Option and header names whose values are secrets: written as ${VAR}, never as the value
_SECRET_NAMES = re.compile(r"token|secret|passw|key|auth|credential|cookie|session", re.IGNORECASE)
_REFERENCE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_EXAMPLE = '\'{"headers": {"Authorization": "Bearer ${HF_TOKEN}"}}\''


def literal_secrets(options):
    """The names of secret-looking values in the storage options written out instead of
    ${VAR}."""
    named = [(k, v) for k, v in options.items() if k != "headers"]
    named += [(f"headers.{k}", v) for k, v in (options.get("headers") or {}).items()]
    return [name for name, value in named if _SECRET_NAMES.search(name.split(".")[-1])
            and isinstance(value, str) and not _REFERENCE.search(value)]  # fmt: skip


def storage_options_problem(text):
    """What is wrong with the storage options' text (None: nothing): a JSON object, its headers
    text, its secrets ${VAR}. Only the text is read: the variables are looked up where the data
    is read (``read_access``)."""
    if not text.strip():
        return None
    try:
        options = json.loads(text)
    except ValueError as e:
        return f"is not JSON ({e}); write a JSON object such as {_EXAMPLE}"
    if not isinstance(options, dict):
        return f"must be a JSON object, such as {_EXAMPLE}"
    headers = options.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        return '"headers" must map header names to text values'
    literal = literal_secrets(options)
    if literal:
        return (
            f"{literal[0]} is written out: write a secret as ${{VAR}} (the environment variable "
            "VAR holds it, e.g. ${HF_TOKEN}), since config.yaml, the log and every checkpoint "
            "record this key as written"
        )
    return None


def read_access(storage_options, readahead_mb, retries, read_timeout, min_rate_kb):
    """How DATA.PATH's URLs are read (``url_access.Access``): DATA_LOADER.STORAGE_OPTIONS with
    each ${VAR} taken from this process's environment, READAHEAD_MB, RETRIES, READ_TIMEOUT and
    MIN_READ_RATE_KB. Asked where the data is read (the machine step, the data builders), never
    while a config is read: a variable that is not set, or whose value no HTTP header may carry,
    is a ConfigError naming it (never its value)."""
    try:
        return url_access.access_from(
            storage_options,
            readahead_mb,
            retries,
            read_timeout=read_timeout,
            min_rate_kb=min_rate_kb,
        )
    except DataPathError as e:  # a variable it names is not set, or not a header
        raise ConfigError(str(e)) from None
