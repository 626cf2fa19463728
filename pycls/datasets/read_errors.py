"""The two ways reading data from a path or URL fails, one per side of the exit-status rule
(docs/trust.md, "Exit statuses of reading data"):

- ``DataPathError``: the path or URL is the user's to fix (exit status 2): a local file or URL
  that does not exist (HTTP 404, 410), a server that refuses access (401, 403), another answer
  of the 4xx kind, a malformed URL, a protocol nothing reads. The message names the URL and what
  the server or the operating system answered.
- ``DataReadError``: the machine failed to read data that should be there (exit status 1): a
  refused connection, a timeout, a dropped connection or a 5xx answer after every attempt, a
  read error of the disk. The message says which, and how many attempts were made.
"""

from pycls.errors import UserError


class DataPathError(UserError, FileNotFoundError):
    """A path or URL of the data that does not exist, is refused or cannot be a URL."""


class DataReadError(OSError):
    """A data file (or a range of it) could not be read after every attempt; the message names
    the file, what was read and the last reason."""
