"""Files that replace their target only once whole, the one way pycls writes a file in place
(config.yaml, checkpoints and weights, shards and their indexes, caches, sweep records, plots,
downloads): written under a temporary name (``PATH.tmp.PID``, which start-up clean-up recognises:
``pycls.checkpoint.files.remove_dead_writers_files``), flushed to disk, optionally checked, then
renamed. A failed write that names no file (a full disk) is raised naming the target; a failed or
interrupted one leaves the target as it was and no temporary file behind. Plain Python, no torch
(the config writes config.yaml with it)."""

import contextlib
import os

__all__ = ["atomic_file", "atomic_path", "write_text_atomic"]


@contextlib.contextmanager
def _replacing(path):
    """Yields the temporary name of ``path``; renames it over ``path`` when the block ends
    without an error, removes it otherwise."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
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
def atomic_path(path, check=None):
    """Yields a temporary name for a writer that takes a path (safetensors, matplotlib); once it
    has written there, the file is flushed to disk, ``check(tmp)`` (when given) may refuse it by
    raising, and it is renamed to ``path``."""
    with _replacing(path) as tmp:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if check is not None:
            check(tmp)


@contextlib.contextmanager
def atomic_file(path, mode="w", check=None):
    """Yields a file open in ``mode`` that replaces ``path`` only once it is whole: flushed to
    disk through the descriptor it was written with, ``check(tmp)`` (when given: the bytes read
    back, say) may refuse it by raising, then renamed."""
    with _replacing(path) as tmp:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check(tmp)


def write_text_atomic(path, text):
    with atomic_file(path) as f:
        f.write(text)
