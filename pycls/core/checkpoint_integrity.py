"""Integrity of sharded (torch.distributed.checkpoint) checkpoint folders, and one error type for
everything that goes wrong with a checkpoint.

- ``seal(folder)``: writes ``manifest.json`` (each file's size and CRC32) once every process has
  written its part; ``verify(path)`` checks it before anything in the folder is read.
- ``reader(path)``: the DCP storage reader to load with; its ``.metadata`` read goes through the
  allowlisting unpickler (pycls.core.safe_unpickle), so a crafted folder executes nothing.
- ``guard(path, action)``: turns whatever torch or DCP raise while reading or writing a checkpoint
  (``CheckpointException`` is a ``BaseException``) into a ``CheckpointError`` naming the path;
  a pickle outside the allowlist becomes ``UntrustedCheckpointError``, a failed write
  ``CheckpointWriteError`` with the cause (disk full, ...) in one line.
"""

import contextlib
import os

from pycls.core import integrity, safe_unpickle
from pycls.core.checkpoint import CheckpointError


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file names Python objects its format never holds; nothing was executed."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, permissions, ...); earlier ones are intact."""


def seal(folder):
    """Records every file of a finished checkpoint folder in its manifest."""
    with guard(folder, "write"):
        integrity.write_manifest(folder)


def verify(path):
    """Raises CheckpointError naming the file unless every file of the folder ``path`` has the
    size and checksum its manifest records, and its DCP metadata unpickles with the allowlist.
    Returns False for a folder without a manifest (written by an older pycls; loaded
    unverified)."""
    try:
        verified = integrity.verify_manifest(path)
    except (integrity.CorruptFileError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from e
    with guard(path):  # a crafted .metadata fails here, before anything else is read
        reader(path).read_metadata()
    return verified


def reader(path):
    return safe_unpickle.reader_for(path)


def _failures(exc):
    """The exceptions behind ``exc``: a DCP CheckpointException's per-rank failures, or itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return [exc]


def _first_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


@contextlib.contextmanager
def guard(path, action="read"):
    """Re-raises any failure inside as a CheckpointError naming ``path``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        causes = _failures(e)
        for cause in causes:
            if isinstance(cause, safe_unpickle.UnsafePickleError):
                raise UntrustedCheckpointError(f"checkpoint {path}: {cause}") from e
            if isinstance(cause, CheckpointError):
                raise cause from e
        if action == "write":
            raise CheckpointWriteError(
                integrity.describe_write_error(path, causes[0] if causes else e)
            ) from e
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded (truncated, corrupt, or not of this model?): "
            f"{_first_line(causes[0])}"
        ) from e


def remove_stale_temporaries(checkpoint_dir):
    """Removes what writers that died left behind (``*.tmp.PID`` files, ``*.tmp`` folders);
    call it only while holding the OUT_DIR lock, so no live writer owns them. Returns them."""
    import shutil

    if not os.path.isdir(checkpoint_dir):
        return []
    removed = []
    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        if name.endswith(".tmp") or ".tmp." in name:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            removed.append(path)
    return removed
