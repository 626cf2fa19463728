"""The ways reading data from a path or URL fails, each on one side of the exit-status rule
(docs/trust.md, "Exit statuses of reading data"):

- ``DataPathError``: the path or URL is the user's to fix (exit status 2): a local file or URL
  that does not exist (HTTP 404, 410), a server that refuses access (401, 403), another answer
  of the 4xx kind, a malformed URL, a protocol nothing reads. The message names the URL and what
  the server or the operating system answered.
- ``DataReadError``: the machine failed to read data that should be there (exit status 1): a
  refused connection, a timeout, a dropped connection or a 5xx answer after every attempt, a
  read error of the disk. The message says which, and how many attempts were made.
- ``DataChangedError``: a file is no longer the one that was indexed (exit status 2, or its
  samples skipped under DATA_LOADER.SKIP_CORRUPT): its server's validator, its size, a tar
  member's header or its SHA-256 differ from what indexing recorded.

A secret read from the environment for a URL (``${VAR}`` in DATA_LOADER.STORAGE_OPTIONS) is
``hide``-n here when it is read, and every message of a failed read passes through
``without_secrets``: the text of another library's exception (a request that could not be sent
quotes its headers) never carries the value into a message or the log.
"""

from pycls.errors import UserError, printable_path

# The values read from the environment for URLs, each with the ${VAR} it replaces in messages
_SECRETS: dict[str, str] = {}
# Shorter values are left alone (they would blank out ordinary words)
_SHORTEST_SECRET = 4


def hide(value: str, name: str) -> None:
    """From now on ``value`` (of environment variable ``name``) reads ``${name}`` in messages."""
    if len(value.strip()) >= _SHORTEST_SECRET:
        _SECRETS[value] = "${" + name + "}"
        _SECRETS[value.strip()] = "${" + name + "}"


def without_secrets(text: str) -> str:
    """``text`` with every hidden value replaced by the name of its variable (longest first)."""
    for value in sorted(_SECRETS, key=len, reverse=True):
        if value in text:
            text = text.replace(value, _SECRETS[value])
    return text


class DataPathError(UserError, FileNotFoundError):
    """A path or URL of the data that does not exist, is refused or cannot be a URL."""


class DataReadError(OSError):
    """A data file (or a range of it) could not be read after every attempt; the message names
    the file, what was read and the last reason."""


class HTTPStatusError(Exception):
    """An answer with an error status (internal: ``read_attempts.classify`` says whose it
    is)."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"HTTP {status} {reason}".strip())
        self.status, self.reason = status, reason


class ShortAnswer(Exception):
    """An answer of another length than asked for (internal: retried)."""


class DataChangedError(UserError, ValueError):
    """A data file changed since it was indexed; ``path`` names it and ``reason`` says what
    differs (what the server answered, the size it states, a header, a digest)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{printable_path(path)} changed since it was indexed: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):
        return type(self), (self.path, self.reason)
