"""Unpickling files as data: only the classes a format needs, nothing that runs code.

``pickle.load`` imports and calls whatever a file names, so a crafted file runs arbitrary code
(``os.system`` through ``__reduce__``). Three formats pycls reads are pickles: the CIFAR python
batches, the ``.metadata`` file of a ``torch.distributed.checkpoint`` (DCP) folder, and the
non-tensor items in a DCP folder's data files (an optimizer group's hyperparameters, each one
``torch.save``d: torch's own reader loads them with ``weights_only=False``). All go through
``load`` here, with an allowlist of the globals that format needs; any other global stops the
load with ``UnsafePickleError`` naming the file, before anything is imported or called.

``pycls.checkpoint.files.reader`` is the DCP reader that uses them.
"""

import io
import pickle
import zipfile

import torch

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


def dcp_item_globals():
    """What a non-tensor item of a DCP folder may name: plain Python values (numbers, strings,
    tuples, lists, dicts need no global), torch dtypes and sizes. Tensors are never stored as
    such items (DCP writes every tensor as a tensor item)."""
    return frozenset({("torch", "Size"), ("collections", "OrderedDict")} | _torch_dtypes())


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


def load_torch_saved(data, allowed, path):
    """The object ``torch.save`` wrote into ``data`` (a zip archive holding one ``data.pkl``),
    unpickled allowing only ``allowed``; storages (tensors) are refused. Raises UnsafePickleError
    for anything else, naming ``path``."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickles = [i for i in archive.infolist() if i.filename.endswith("data.pkl")]
            if len(pickles) != 1:
                raise UnsafePickleError(f"{path}: {len(pickles)} data.pkl records in one item")
            info = pickles[0]
            # torch.save stores, never compresses: a record that claims to expand is crafted
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                raise UnsafePickleError(f"{path}: a compressed or oversized record in an item")
            return loads(archive.read(info), allowed, path)
    except zipfile.BadZipFile as e:
        raise UnsafePickleError(f"{path}: an item is not a torch-saved object ({e})") from None
