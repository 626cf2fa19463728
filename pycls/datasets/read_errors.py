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
"""

from pycls.errors import UserError, printable_path


class DataPathError(UserError, FileNotFoundError):
    """A path or URL of the data that does not exist, is refused or cannot be a URL."""


class DataReadError(OSError):
    """A data file (or a range of it) could not be read after every attempt; the message names
    the file, what was read and the last reason."""


class DataChangedError(UserError, ValueError):
    """A data file changed since it was indexed; ``path`` names it and ``reason`` says what
    differs (what the server answered, the size it states, a header, a digest)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{printable_path(path)} changed since it was indexed: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):
        return type(self), (self.path, self.reason)
