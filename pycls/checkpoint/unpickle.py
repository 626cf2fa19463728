"""Unpickling files as data: only the classes a format needs, nothing that runs code.

``pickle.load`` imports and calls whatever a file names, so a crafted file runs arbitrary code
(``os.system`` through ``__reduce__``). Two formats pycls reads are pickles: the CIFAR python
batches and the ``.metadata`` file of a ``torch.distributed.checkpoint`` folder (read by torch's
``FileSystemReader`` with a plain ``pickle.load``). Both go through ``load`` here, with an
allowlist of the globals that format needs; any other global stops the load with
``UnsafePickleError`` naming the file, before anything is imported or called.

``SafeFileSystemReader`` is torch's reader with the metadata read replaced; pass it as
``storage_reader`` to ``dcp.load`` (``reader_for`` builds one).
"""

import io
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from pycls.errors import UserError


class UnsafePickleError(UserError, pickle.UnpicklingError):
    """A pickle names a global outside the allowlist of its format; nothing was executed."""


def _torch_dtypes():
    return {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}


# numpy arrays as pickled by numpy 1 (numpy.core) and numpy 2 (numpy._core)
NUMPY_ARRAYS = frozenset(
    {(f"numpy.{core}.multiarray", "_reconstruct") for core in ("core", "_core")}
    | {("numpy", "ndarray"), ("numpy", "dtype")}
    | {(f"numpy.{core}.multiarray", "scalar") for core in ("core", "_core")}
    | {("_codecs", "encode")}  # bytes in protocol-2 pickles written by Python 3
)

_DCP_METADATA_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)


def dcp_metadata_globals():
    """What a DCP ``.metadata`` file of this torch may name: its metadata dataclasses, torch sizes,
    dtypes and layouts, and file paths."""
    allowed = {("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA_CLASSES}
    allowed |= {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by name
        ("torch", "Size"),
        ("collections", "OrderedDict"),
    }
    allowed |= {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath")}
    allowed |= {("pathlib", n) for n in ("PureWindowsPath",)}
    return frozenset(allowed | _torch_dtypes())


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed, path, **kwargs):
        super().__init__(file, **kwargs)
        self._allowed, self._path = allowed, path

    def find_class(self, module, name):
        if (module, name) not in self._allowed:
            raise UnsafePickleError(
                f"{self._path}: refusing to load {module}.{name}: the file names a Python "
                "object that this format never holds (a crafted or foreign file?); nothing "
                "was executed"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnsafePickleError(f"{self._path}: unexpected persistent id in a data pickle")


def load(file, allowed, path, **kwargs):
    """Unpickles ``file`` (a binary stream) allowing only the (module, name) globals in
    ``allowed``; ``path`` names the file in errors. ``kwargs`` go to ``pickle.Unpickler``."""
    return _AllowlistUnpickler(file, allowed, path, **kwargs).load()


def loads(data, allowed, path, **kwargs):
    return load(io.BytesIO(data), allowed, path, **kwargs)


def _safe_reader_class():
    class SafeFileSystemReader(FileSystemReader):
        """torch's DCP FileSystemReader whose ``.metadata`` read allows only metadata classes."""

        def read_metadata(self, *args, **kwargs):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = load(f, dcp_metadata_globals(), str(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


_READER = None


def reader_for(path):
    """A DCP storage reader for the folder ``path`` whose metadata read executes nothing."""
    global _READER
    if _READER is None:
        _READER = _safe_reader_class()
    return _READER(pathlib.Path(path))
