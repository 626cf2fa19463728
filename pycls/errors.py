"""The exceptions for mistakes in what the user asked for, and one-line descriptions of failed
writes. The lowest layer of pycls: it imports nothing of pycls.

A ``UserError`` is a bad config value, a path that does not exist, a checkpoint that does not fit
the model: things the user fixes, not bugs in pycls. Its message names the key or path and says
what to do. The command line (pycls.core.cli) prints it as one line and exits with
``EXIT_USER_ERROR``; any other exception is a bug and keeps its traceback.
"""

import errno
import os

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the input (config, paths, files); ``one_line()`` is what the user sees."""

    prefix = "error"

    def one_line(self):
        return f"{self.prefix}: " + " ".join(str(self).split())


class ReportedError(UserError):
    """A UserError raised in a spawned process and passed to the parent as its one line."""

    def one_line(self):
        return str(self)


class ConfigError(UserError, ValueError):
    """A config key has a bad value; the message names the key."""

    prefix = "config error"


def require(ok, key, msg):
    """Raises ConfigError naming ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def os_error_in(exc):
    """The OSError behind ``exc`` (itself, or one in its cause/context chain), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def describe_write_error(path, exc):
    """One line for a failed write of ``path``: the cause in words, without a traceback."""
    os_err = os_error_in(exc)
    if os_err is not None and os_err.errno is not None:
        cause = os.strerror(os_err.errno)
        if os_err.errno in (errno.ENOSPC, errno.EDQUOT):
            cause += " (free some space or choose another OUT_DIR)"
        return f"cannot write {path}: {cause} [{errno.errorcode.get(os_err.errno, os_err.errno)}]"
    return f"cannot write {path}: {type(exc).__name__}: {exc}"
