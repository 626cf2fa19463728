"""Files that can be trusted: written atomically, checksummed, sealed with a manifest, read
without running code; and the one error type for everything that goes wrong with a checkpoint.

- ``atomic_file`` (``pycls.atomic_files``): a file replaces its target only once whole.
- ``file_record`` / ``verify_file``: a file's size and CRC32, checked before it is trusted.
- ``write_manifest`` / ``verify_manifest``: ``manifest.json`` in a folder (a sharded checkpoint,
  a shard set) listing every file with its size and CRC32; a missing, truncated or altered file
  fails with ``CorruptFileError`` naming it.
- ``seal(folder)`` / ``verify(path)``: a sharded (torch.distributed.checkpoint) folder's manifest,
  written once every process has written its part and checked before anything in it is read.
- ``reader(path)``: the DCP storage reader to load with. Its ``.metadata`` and every non-tensor
  item of the data files go through the allowlisting unpickler (``pycls.checkpoint.unpickle``), so
  a crafted folder executes nothing; and every size the metadata claims (a tensor's elements,
  an item's offset and length) is checked against the files before anything is allocated.
- ``guard(path, action)``: turns whatever torch or DCP raise while reading or writing a checkpoint
  (``CheckpointException`` is a ``BaseException``) into a ``CheckpointError`` naming the path;
  a pickle outside the allowlist becomes ``UntrustedCheckpointError``, a failed write
  ``CheckpointWriteError`` with the cause (disk full, ...) in one line.
"""

import contextlib
import io
import json
import math
import os
import pathlib
import re
import shutil
import zlib

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from pycls.atomic_files import write_text_atomic
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
    """A DCP storage reader for the folder ``path`` that executes nothing and allocates nothing
    its metadata claims before the claim is checked against the files (``SafeReader``)."""
    return SafeReader(pathlib.Path(path))


class SafeReader(FileSystemReader):
    """torch's DCP ``FileSystemReader`` reading as data only: the ``.metadata`` pickle with the
    metadata allowlist, checked against the folder's files (``check_claims``); each non-tensor
    item with the item allowlist (torch's own reader ``torch.load``s them with
    ``weights_only=False``)."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        if not os.path.isfile(path):  # missing, or a FIFO that would block the read
            raise CheckpointError(f"checkpoint {self.path}: {path} is missing or no regular file")
        with self.fs.create_stream(path, "rb") as f:
            metadata = unpickle.load(f, unpickle.dcp_metadata_globals(), str(path))
        check_claims(str(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _VettedItems(planner, str(self.path)))


class _VettedItems:
    """A load planner as torch's reader sees it, with each non-tensor item unpickled with the
    allowlist before the planner gets it (re-saved: the planner's own load then reads only
    plain values). An object where the planner holds a tensor is refused."""

    def __init__(self, planner, folder):
        self._planner, self._folder = planner, folder

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value):
        fqn = read_item.dest_index.fqn
        where = f"{self._folder}: item {fqn}"
        obj = unpickle.load_torch_saved(value.read(), unpickle.dcp_item_globals(), where)
        if isinstance(getattr(self._planner, "state_dict", {}).get(fqn), torch.Tensor):
            raise CheckpointError(f"checkpoint {where} holds a {type(obj).__name__}, not a tensor")
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


def check_claims(folder, metadata):
    """Raises CheckpointError unless what the DCP ``metadata`` of ``folder`` claims fits its
    files: every item lies inside a data file of the folder (no other path, no transform such as
    compression, which pycls never writes), and every tensor's chunks cover it and each holds
    no more elements than its item has bytes for. A 2**40-element claim in a small folder is
    refused here, before a tensor of that size is allocated."""
    sizes = {}
    for index, info in metadata.storage_data.items():
        name = str(info.relative_path)
        where = f"checkpoint {folder}: item {index.fqn}"
        if name != os.path.basename(name) or name in ("", ".", ".."):
            raise CheckpointError(f"{where} names a file outside the folder: {name!r}")
        if name not in sizes:
            file = os.path.join(folder, name)
            if not os.path.isfile(file):
                raise CheckpointError(f"{where} is in {name}, which is missing")
            sizes[name] = os.path.getsize(file)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} is stored transformed ({info.transform_descriptors})")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
            raise CheckpointError(
                f"{where} claims bytes {info.offset}..{info.offset + info.length} of {name}, "
                f"which has {sizes[name]}"
            )
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            _check_tensor_claim(folder, fqn, meta, metadata.storage_data)


def _check_tensor_claim(folder, fqn, meta, storage):
    where = f"checkpoint {folder}: tensor {fqn}"
    size = tuple(meta.size)
    if any(d < 0 for d in size):
        raise CheckpointError(f"{where} claims the size {size}")
    itemsize = meta.properties.dtype.itemsize
    covered = 0
    for chunk in meta.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        inside = len(offsets) == len(sizes) == len(size) and all(
            o >= 0 and n >= 0 and o + n <= d for o, n, d in zip(offsets, sizes, size)
        )
        info = storage.get(MetadataIndex(fqn, offsets))
        if not inside or info is None:
            raise CheckpointError(f"{where}: a chunk {sizes} at {offsets} has no place or no data")
        elements = math.prod(sizes)
        if elements * itemsize > info.length:
            raise CheckpointError(
                f"{where} claims {elements} elements ({elements * itemsize} bytes) in a chunk "
                f"of {info.length} bytes: truncated or crafted"
            )
        covered += elements
    if covered < math.prod(size):
        raise CheckpointError(
            f"{where} claims {math.prod(size)} elements, its chunks hold {covered}: crafted?"
        )


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
    call it only while holding the OUT_DIR lock, so no live run owns them (a live export's file,
    its process still running here, stays). Returns them."""
    if not os.path.isdir(checkpoint_dir):
        return []
    removed = []
    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        m = _TMP_FILE.search(name)
        if m and _writer_alive(int(m.group(1))):
            continue
        if name.endswith(".tmp") or ".tmp." in name:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            removed.append(path)
    return removed


_TMP_FILE = re.compile(r"\.tmp\.(\d+)$")


def _writer_alive(pid):
    if pid == os.getpid():  # this process, starting: not writing anything yet
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_dead_writers_files(folder):
    """Removes the ``NAME.tmp.PID`` files (``atomic_path``'s temporaries: model_final, config.yaml,
    exports) directly in ``folder`` whose writing process is gone from this machine; a live
    one's (an export running beside the run) and every other file stay. Returns them."""
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        m = _TMP_FILE.search(name)
        if m and not _writer_alive(int(m.group(1))) and not os.path.isdir(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            removed.append(path)
    return removed
