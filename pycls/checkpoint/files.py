"""Files that can be trusted: written atomically, checksummed, sealed with a manifest, read
without running code; and the one error type for everything that goes wrong with a checkpoint.

- ``atomic_file``: a file replaces its target only once whole (temporary name, fsync, rename).
- ``file_record`` / ``verify_file``: a file's size and CRC32, checked before it is trusted.
- ``write_manifest`` / ``verify_manifest``: ``manifest.json`` in a folder (a sharded checkpoint,
  a shard set) listing every file with its size and CRC32; a missing, truncated or altered file
  fails with ``CorruptFileError`` naming it.
- ``seal(folder)`` / ``verify(path)``: a sharded (torch.distributed.checkpoint) folder's manifest,
  written once every process has written its part and checked before anything in it is read.
- ``reader(path)``: the DCP storage reader to load with; its ``.metadata`` read goes through the
  allowlisting unpickler (``pycls.checkpoint.unpickle``), so a crafted folder executes nothing.
- ``guard(path, action)``: turns whatever torch or DCP raise while reading or writing a checkpoint
  (``CheckpointException`` is a ``BaseException``) into a ``CheckpointError`` naming the path;
  a pickle outside the allowlist becomes ``UntrustedCheckpointError``, a failed write
  ``CheckpointWriteError`` with the cause (disk full, ...) in one line.
"""

import contextlib
import json
import os
import shutil
import zlib

from torch.distributed.checkpoint.api import CheckpointException

from pycls.checkpoint import unpickle
from pycls.errors import EnvironmentFailure, UserError, describe_write_error

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class CorruptFileError(UserError, ValueError):
    """A file is missing, or its size or checksum differs from the one recorded when written."""


def crc32_of_file(path):
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_record(path):
    """{"size": bytes, "crc32": checksum} of a file."""
    return {"size": os.path.getsize(path), "crc32": crc32_of_file(path)}


def verify_file(path, record, what="file"):
    """Raises CorruptFileError naming ``path`` unless it has the recorded size and checksum."""
    if not os.path.isfile(path):
        raise CorruptFileError(f"{what} {path} is missing")
    size = os.path.getsize(path)
    if size != record["size"]:
        raise CorruptFileError(
            f"{what} {path} is {size} bytes, {record['size']} were written (truncated or altered)"
        )
    if "crc32" in record and crc32_of_file(path) != record["crc32"]:
        raise CorruptFileError(f"{what} {path} is corrupt: its contents fail the CRC32 check")


def write_manifest(folder, exclude=()):
    """Records every file under ``folder`` (relative paths) in ``folder/manifest.json``."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST and rel not in exclude:
                files[rel] = file_record(os.path.join(folder, rel))
    data = json.dumps({"version": 1, "files": dict(sorted(files.items()))}, indent=1)
    write_text_atomic(os.path.join(folder, MANIFEST), data)
    return files


def read_manifest(folder):
    """The manifest's {relative path: record}, or None when the folder has none."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        return {
            str(k): {"size": int(v["size"]), "crc32": int(v["crc32"])} for k, v in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptFileError(f"manifest {path} is unreadable: {type(e).__name__}: {e}") from None


def verify_manifest(folder):
    """Checks every file the manifest lists; returns False when there is no manifest (a folder
    written before manifests existed), True when all files verify."""
    files = read_manifest(folder)
    if files is None:
        return False
    for rel, record in files.items():
        verify_file(os.path.join(folder, rel), record)
    return True


@contextlib.contextmanager
def atomic_file(path, mode="w"):
    """Yields a file that replaces ``path`` only once it is whole: written under a temporary name
    (``PATH.tmp.PID``, which start-up clean-up recognises), flushed to disk, renamed. A failed or
    interrupted write leaves ``path`` as it was."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path, text):
    with atomic_file(path) as f:
        f.write(text)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, truncated, corrupt or does not fit the model."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file names Python objects its format never holds; nothing was executed."""


class CheckpointWriteError(CheckpointError, EnvironmentFailure):
    """A checkpoint could not be written (disk full, permissions, ...); earlier ones are intact.
    The machine's failure, not the input's: the commands exit with ``EXIT_ENVIRONMENT``."""


def seal(folder):
    """Records every file of a finished checkpoint folder in its manifest."""
    with guard(folder, "write"):
        write_manifest(folder)


def verify(path):
    """Raises CheckpointError naming the file unless every file of the folder ``path`` has the
    size and checksum its manifest records, and its DCP metadata unpickles with the allowlist.
    Returns False for a folder without a manifest (written by an older pycls; loaded
    unverified)."""
    try:
        verified = verify_manifest(path)
    except (CorruptFileError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from e
    with guard(path):  # a crafted .metadata fails here, before anything else is read
        reader(path).read_metadata()
    return verified


def reader(path):
    return unpickle.reader_for(path)


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
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        causes = _failures(e)
        for cause in causes:
            if isinstance(cause, unpickle.UnsafePickleError):
                raise UntrustedCheckpointError(f"checkpoint {path}: {cause}") from e
            if isinstance(cause, CheckpointError):
                raise cause from e
        if action == "write":
            raise CheckpointWriteError(
                describe_write_error(path, causes[0] if causes else e)
            ) from e
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded (truncated, corrupt, or not of this model?): "
            f"{_first_line(causes[0])}"
        ) from e


def remove_stale_temporaries(checkpoint_dir):
    """Removes what writers that died left behind (``*.tmp.PID`` files, ``*.tmp`` folders);
    call it only while holding the OUT_DIR lock, so no live writer owns them. Returns them."""
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
