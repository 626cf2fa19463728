"""The exceptions for mistakes in what the user asked for, and one-line descriptions of failed
writes. The lowest layer of pycls: it imports nothing of pycls.

A ``UserError`` is a bad config value, a path that does not exist, a file given that is corrupt
or not of its kind, a checkpoint that does not fit the model: things the user fixes, not bugs in
pycls. Its message names the key or path and says what to do. An ``EnvironmentFailure`` (or any
other ``OSError``) is the machine's: a full disk, a file the system will not read or write. Every
command of ``pycls`` prints either as one line (``reported``) and exits with the status of the
table below; any other exception is a bug and keeps its traceback.

Exit statuses of every pycls command:

====  ============================================================================================
0     done
1     the machine failed (``EXIT_ENVIRONMENT``): a full disk or quota, a file the system would
      not read or write, a data server that refuses the connection, stays silent or answers 5xx
      after every attempt. One line naming the file or URL; the same command works once the
      machine is fixed. (``prepare --verify``: corruption found.)
2     a user mistake (``EXIT_USER_ERROR``): a bad key or value, a missing path (a zoo file that
      is neither in MODEL.ZOO_DIR nor downloadable included; a data URL answered 404 or 403, a
      malformed URL), an input file that is corrupt, unsafe or not what it should be (image,
      checkpoint, weights, shards, sweep file, sweep.json), a conversion the target cannot
      express, an OUT_DIR another run holds
3     the loss became inf or NaN (``EXIT_DIVERGED``)
75    stopped by a preemption signal after a checkpoint (or, stopped while waiting for data before
      training, with nothing to lose: ``WaitStopped``); resubmit to resume
130   stopped by Ctrl-C
====  ============================================================================================
"""

import errno
import os
import re

EXIT_ENVIRONMENT = 1
EXIT_USER_ERROR = 2
# The loss became inf or NaN: neither a user mistake nor a bug, and a scheduler should not retry
# it as it is (75, a preempted run, is retried)
EXIT_DIVERGED = 3


class UserError(Exception):
    """A mistake in the input (config, paths, files); ``one_line()`` is what the user sees."""

    prefix = "error"

    def one_line(self):
        return printable(f"{self.prefix}: " + " ".join(original_message(str(self)).split()))


class EnvironmentFailure(Exception):
    """The machine failed a command that was right (a full disk); ``one_line()`` is
    what the user sees, with exit status ``EXIT_ENVIRONMENT``."""

    def one_line(self):
        return printable("error: " + " ".join(original_message(str(self)).split()))


def original_message(text):
    """The message of an exception raised in a data-loader worker: torch re-raises it in the main
    process with the worker's whole traceback as its message, whose last line is
    ``module.ClassName: the original message``. Any other text is returned as it is."""
    if "Original Traceback" not in text:
        return text
    last = text.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


class ReportedError(UserError):
    """A UserError raised in a spawned process and passed to the parent as its one line."""

    def one_line(self):
        return printable(str(self))


class ReportedFailure(EnvironmentFailure):
    """An environment failure in a spawned process, passed to the parent as its one line."""

    def one_line(self):
        return printable(str(self))


class WaitStopped(Exception):
    """A wait for data (a read from a URL, a retry's pause, an index build) that a stop signal
    ended: the run stops where it is, with the stop's status (``code``: 75 after SIGTERM or
    SIGUSR1, 130 after Ctrl-C). The trainer writes the checkpoint of the last step it finished
    first; before training nothing is lost."""

    def __init__(self, message, code=75):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return type(self), (str(self), self.code)

    def one_line(self):
        return printable("stopped: " + " ".join(original_message(str(self)).split()))


class DivergedError(FloatingPointError):
    """Training stopped because the loss is not finite; the message says where and what to try.
    The command line prints it as one line and exits with ``EXIT_DIVERGED``."""


class ConfigError(UserError, ValueError):
    """A config key has a bad value; the message names the key."""

    prefix = "config error"


# What the commands report in one line, each with its status (the table above); anything else
# is a bug, reported with its traceback
REPORTED = (EnvironmentFailure, UserError, OSError, DivergedError, WaitStopped)


def reported(exc):
    """(exit status, the one line to print) of a ``REPORTED`` exception. An EnvironmentFailure
    wins over a UserError (a checkpoint that cannot be written is both), and a UserError over an
    OSError (a file the user named that is missing)."""
    if isinstance(exc, EnvironmentFailure):
        return EXIT_ENVIRONMENT, exc.one_line()
    if isinstance(exc, UserError):
        return EXIT_USER_ERROR, exc.one_line()
    if isinstance(exc, DivergedError):
        return EXIT_DIVERGED, printable(f"error: {exc}")
    if isinstance(exc, WaitStopped):
        return exc.code, exc.one_line()
    return EXIT_ENVIRONMENT, printable(f"error: {environment_message(exc)}")


def environment_message(exc):
    """One line for an OSError of the machine (not a bug): the file and the cause in words, with
    what to do about a full disk."""
    code, name = exc.errno, getattr(exc, "filename", None)
    if code is None:
        return " ".join(original_message(str(exc)).split())
    cause = os.strerror(code)
    if code in (errno.ENOSPC, errno.EDQUOT):
        cause += " (free some space or choose another OUT_DIR)"
    where = f"{printable_path(name)}: " if name is not None else ""
    return f"{where}{cause} [{errno.errorcode.get(code, code)}]"


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


def _free_bytes(path):
    """Bytes free to this user on the file system holding ``path`` (or its nearest existing
    parent), or None when that cannot be read."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# Less free space than this after a failed write: the disk filled up (the failure's own message
# need not say so: torch's zip writer reports "unexpected pos", and an error raised in another
# process arrives without its OSError)
_FULL_BYTES = 1 << 20


def _write_errno(path, exc):
    os_err = os_error_in(exc)
    if os_err is not None and os_err.errno is not None:
        return os_err.errno
    text = str(exc)
    if "No space left on device" in text or "[Errno 28]" in text:
        return errno.ENOSPC
    if "Disk quota exceeded" in text or "[Errno 122]" in text:
        return errno.EDQUOT
    free = _free_bytes(path)
    if free is not None and free < _FULL_BYTES:
        return errno.ENOSPC
    return None


def describe_write_error(path, exc):
    """One line for a failed write of ``path``: the cause in words, without a traceback. A full
    disk is named as such whichever writer failed."""
    code = _write_errno(path, exc)
    if code is not None:
        cause = os.strerror(code)
        if code in (errno.ENOSPC, errno.EDQUOT):
            cause += " (free some space or choose another OUT_DIR)"
        return f"cannot write {path}: {cause} [{errno.errorcode.get(code, code)}]"
    return f"cannot write {path}: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc):
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


# ------------------------------------------------------------------------------------------------ #
# Names that are bytes: file names need not be UTF-8 and may hold newlines
# ------------------------------------------------------------------------------------------------ #

_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape_char(ch):
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as os.fsdecode carries it
        return f"\\x{code - 0xDC00:02x}"
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable_path(path):
    """A file name (str, bytes or path) as one printable line that any UTF-8 log or text file
    can hold: bytes that are not UTF-8 become ``\\xNN``, control characters (a newline) their
    escapes, and a backslash is doubled, so that the text names exactly one file."""
    name = os.fsdecode(path)
    if name.isprintable() and "\\" not in name:
        return name
    return "".join(ch if ch.isprintable() and ch != "\\" else _escape_char(ch) for ch in name)


def printable(text):
    """``text`` (a message that may quote a file name) writable as UTF-8: the undecodable bytes
    of a name (surrogates) become ``\\xNN``; everything else is kept."""
    if not _SURROGATE.search(text):
        return text
    return _SURROGATE.sub(lambda m: _escape_char(m.group()), text)


def one_line(text):
    """``text`` on one printable line: surrogates and line breaks escaped (not backslashes)."""
    text = printable(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == "\\" else _escape_char(ch) for ch in text)
