"""What the settings of a read from a URL may be, and the Access they make where the data is read
(the config's checks and the builders both ask here; the keys are DATA_LOADER's):

- a read that keeps failing reports within a day: its attempts (RETRIES) each wait up to
  READ_TIMEOUT for a silent server, with pauses doubling from ``RETRY_PAUSE`` up to
  ``MAX_RETRY_PAUSE`` between them (``read_wait_s``, ``max_retries``);
- STORAGE_OPTIONS is a JSON object whose headers are text and whose secrets are written as
  ``${VAR}`` (``storage_options_problem``), since config.yaml, the log and every checkpoint record
  the key as written; a value is never shown in a message;
- ``UrlReadSettings``: those settings, each declared once (the config's DATA_LOADER keys of them
  are generated from its fields: ``pycls.config.sections.data``);
- ``read_access``: the ``Access`` of those settings, each ``${VAR}`` taken from this process's
  environment: a variable that is not set, or whose value no HTTP header may carry, is refused
  there, naming it (never its value), as a mistake of the config.

Plain Python, no torch: a config's checks run before torch loads.
"""

import functools
import json
import re
from dataclasses import dataclass

from pycls.datasets.transport import read_attempts, read_deadlines, url_access
from pycls.datasets.transport.read_errors import DataPathError
from pycls.errors import ConfigError
from pycls.options import option

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


@dataclass(frozen=True)
class UrlReadSettings:
    """How a run reads its data from URLs: the arguments of ``read_access``."""

    retries: int = option(
        3,
        "Attempts of a read from a URL (a dropped connection, a 5xx answer, a short answer, an "
        "attempt below the floor of READ_TIMEOUT and MIN_READ_RATE_KB), ranges and whole files "
        "alike, before the run stops with an error naming the file and the member. At most as "
        "many as a read that keeps failing gets through in a day (each may wait READ_TIMEOUT for "
        "a silent server; the pauses between them double from 0.2 s up to 60 s): 724 at the "
        "default READ_TIMEOUT",
        bounds="positive",
    )
    read_timeout: float = option(
        _READ_TIMEOUT,
        "Each attempt of a read from an http(s) URL is held to a floor: it fails (and is tried "
        "again, up to RETRIES) when a window of READ_TIMEOUT seconds passes in which less than "
        "MIN_READ_RATE_KB KiB a second arrived: a server silent that long, or one that trickles a "
        "byte a second. The log names the URL and the rate seen (docs/data_formats.md, "
        '"Streaming from a URL")',
        bounds="positive",
    )
    min_read_rate_kb: float = option(
        16.0,
        "The floor's rate (KiB/s; see READ_TIMEOUT): 16 KiB/s bounds an 8 MiB range at 9 minutes "
        "and a 256 MiB shard at 4.6 hours; a slow link shared by many loader processes may need "
        "less",
        bounds="positive",
    )
    readahead_mb: int = option(
        256,
        "What each loader process may keep of a URL's files read whole (MiB). Shards at a URL "
        "are read whole, once, and kept when the shards a batch draws from fit (the "
        "SHUFFLE_BUFFER samples' shards under ORDER shards, all of them under global); else each "
        "batch's byte ranges are read, those of one shard lying close together as one range, 8 "
        "at a time per process. A server without byte ranges gets its files read whole whatever "
        "this says (a parquet file larger than this is then refused); 0 reads by ranges only. "
        'See docs/data_formats.md, "Streaming from a URL"',
        bounds="non_negative",
    )
    storage_options: str = option(
        "",
        'What a URL needs to be read, as a JSON object: for http(s), "headers" (e.g. '
        '{"headers": {"Authorization": "Bearer ${HF_TOKEN}"}}, sent to the server the URL '
        "names, never to another one a redirect leads to); for other protocols, fsspec's "
        'storage options (s3fs\'s "anon", "key", "secret"; hf\'s "token" ...). ${VAR} '
        "is replaced by the environment variable VAR when the data is read (where the run runs, "
        "never when the config is read): write secrets so (a literal token is refused), since "
        "config.yaml, the log and every checkpoint record this key as written. No value is ever "
        "shown in a message",
    )


def read_access(settings: UrlReadSettings):
    """How DATA.PATH's URLs are read (``url_access.Access``): the storage options with each
    ${VAR} taken from this process's environment, the readahead, the attempts and the floor of
    each (``settings``). Asked where the data is read (the machine step, the data builders),
    never while a config is read: a variable that is not set, or whose value no HTTP header may
    carry, is a ConfigError naming it (never its value)."""
    try:
        return url_access.access_from(
            settings.storage_options,
            settings.readahead_mb,
            settings.retries,
            read_timeout=settings.read_timeout,
            min_rate_kb=settings.min_read_rate_kb,
        )
    except DataPathError as e:  # a variable it names is not set, or not a header
        raise ConfigError(str(e)) from None
