"""Files that replace their target only once whole: written under a temporary name
(``PATH.tmp.PID``, which start-up clean-up recognises: ``files.remove_dead_writers_files``),
flushed to disk, renamed; a failed write that names no file (a full disk) is raised naming the
target. Plain Python, no torch (the config writes config.yaml with it)."""

import contextlib
import os

__all__ = ["atomic_file", "atomic_path", "write_text_atomic"]


@contextlib.contextmanager
def atomic_path(path):
    """Yields a temporary name (``PATH.tmp.PID``, which start-up clean-up recognises) for a
    writer that takes a path (safetensors); once it has written there, the file is flushed to
    disk and renamed to ``path``. A failed or interrupted write leaves ``path`` as it was."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        # a write or flush names no file ("No space left on device"): the one that failed
        raise OSError(e.errno, e.strerror, os.fspath(path)) from e
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def atomic_file(path, mode="w"):
    """Yields a file that replaces ``path`` only once it is whole: written under a temporary name
    (``PATH.tmp.PID``, which start-up clean-up recognises), flushed to disk, renamed. A failed or
    interrupted write leaves ``path`` as it was."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()


def write_text_atomic(path, text):
    with atomic_file(path) as f:
        f.write(text)
