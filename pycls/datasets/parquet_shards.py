"""Hugging Face datasets' parquet files (the Hub's ``imagenet-1k``, timm's ``hfds/``), read by
sample index through pyarrow: ``ParquetShards``.

A sample is a row: its image in the ``image`` column (the Hub's Image feature, a struct of
``bytes`` and ``path``, or plain binary; ``img``, ``jpg`` and ``png`` are also looked for) and its
class in ``label`` (or ``labels``, ``fine_label``, ``cls``). The class names come from the
file's ``huggingface`` schema metadata (a ClassLabel feature) where it has them.

Parquet is read by row group: a sample's image is read with the other rows of its row group, and
each loader process keeps the last few row groups it read. Orders that read the files shard by
shard (DATA_LOADER.ORDER shards, each process a run of consecutive samples) read a row group
about once; a global random order reads one per sample. Opening reads each file's footer and its
label column only. A file that is not parquet, or lacks the columns, is refused in one line
naming it; an image that does not decode is a ``CorruptImageError`` naming the file and row.
"""

import json
import os
from collections import OrderedDict

import numpy as np
import torch
from torch.utils.data import Dataset

from pycls.checkpoint.files import CorruptFileError
from pycls.datasets import labels, remote_files
from pycls.datasets import parquet_bounds as bounds
from pycls.datasets.image_header import DEFAULT_MAX_PIXELS, too_many_bytes
from pycls.datasets.imagefolder import CorruptImageError
from pycls.datasets.tar_shards import decode_image
from pycls.errors import printable_path

IMAGE_COLUMNS = ("image", "img", "jpg", "png")
LABEL_COLUMNS = ("label", "labels", "fine_label", "cls")
# Row groups each loader process keeps (one batch of a shard-wise order spans one or two)
_KEPT_ROW_GROUPS = 4
# The defaults of DATA_LOADER.MAX_DECOMPRESSED_BYTES and MAX_COMPRESSION_RATIO
MAX_DECOMPRESSED_BYTES = 1 << 30
MAX_COMPRESSION_RATIO = 100


def _pq():
    import pyarrow.parquet as pq  # optional (pip install pycls-vit[data]): parquet data only

    return pq


def _pa():
    import pyarrow as pa  # optional (pip install pycls-vit[data]): parquet data only

    return pa


def _one_of(names, wanted, path, what):
    found = next((n for n in wanted if n in names), None)
    if found is None:
        raise CorruptFileError(
            f"{printable_path(path)} has no {what} column ({' or '.join(wanted)}); its columns: "
            f"{list(names)}"
        )
    return found


def hf_class_names(schema, column: str) -> list | None:
    """The class names of a ClassLabel ``column`` in a file written by Hugging Face datasets."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    features = meta.get("info", {}).get("features") or meta.get("features") or {}
    feature = features.get(column) if isinstance(features, dict) else None
    if isinstance(feature, dict) and isinstance(feature.get("names"), list):
        return list(feature["names"])
    return None


def _check_image_type(field, path: str) -> None:
    """The image column holds encoded images: binary, or the Hub's Image struct of ``bytes``
    (and ``path``); numbers or booleans are refused at open, naming the column."""
    pa = _pa()
    kind = field.type
    if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
        kind = kind.field("bytes").type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) or (
        pa.types.is_temporal(kind) or pa.types.is_nested(kind) and not pa.types.is_struct(kind)
    ):  # fmt: skip
        raise CorruptFileError(
            f"{printable_path(path)}: its image column {field.name!r} holds {kind} values, not "
            "encoded images (bytes, or the Image feature's struct of bytes and path)"
        )


def _chunks(meta) -> list:
    """Every column chunk of the file, for the page checks (only those read are checked)."""
    out = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for i in range(group.num_columns):
            column = group.column(i)
            start, stored = bounds.chunk_span(column)
            what = f"row group {g}, column {column.path_in_schema}"
            out.append(bounds.Chunk(start, stored, column.total_uncompressed_size, what))
    return out


class ParquetShards(Dataset):
    """Raw ``(uint8 (3, H, W), label)`` samples of parquet files (paths or URLs), row after row.

    Attributes: ``labels``, ``shard_sizes`` (rows per file), ``num_classes`` and ``classes``
    (the ClassLabel names where recorded, else the largest label + 1 and None), ``folder``.
    """

    def __init__(
        self,
        files: list[str],
        *,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        retries: int = 3,
        where: str = "",
        num_classes: int | None = None,
        max_decompressed: int = MAX_DECOMPRESSED_BYTES,
        max_ratio: float = MAX_COMPRESSION_RATIO,
    ):
        if not files:
            raise ValueError("no parquet files to read")
        self.files, self.max_pixels, self.retries = list(files), max_pixels, retries
        self.folder, self.max_decompressed, self.max_ratio = where, max_decompressed, max_ratio
        self._open: dict = {}
        self._kept: OrderedDict = OrderedDict()
        labels, group_rows, columns, self._leaves, names = [], [], [], [], None
        for path in self.files:
            file = self._parquet(path)
            meta, schema = file.metadata, file.schema_arrow
            image = _one_of(schema.names, IMAGE_COLUMNS, path, "image")
            label = _one_of(schema.names, LABEL_COLUMNS, path, "label")
            _check_image_type(schema.field(image), path)
            columns.append((image, label))
            leaves = (bounds.leaf_columns(meta, image), bounds.leaf_columns(meta, label))
            self._leaves.append(leaves)
            bounds.check_footer(meta, path, file.size, leaves[0] + leaves[1])
            own = hf_class_names(schema, label)
            names = names or own
            group_rows.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
            labels.append(self._labels(path, file, label, own, num_classes))
        self._columns = columns
        self.shard_sizes = [int(sum(rows)) for rows in group_rows]
        # Per file, the first sample of each of its row groups
        self._group_starts = [np.cumsum([0] + rows[:-1]) for rows in group_rows]
        self._file_starts = np.cumsum([0] + self.shard_sizes[:-1])
        self.labels = torch.from_numpy(np.concatenate(labels))
        largest = int(self.labels.max()) + 1 if len(self.labels) else 0
        self.classes = names if names is not None and len(names) >= largest else None
        self.num_classes = len(self.classes) if self.classes is not None else largest
        self._open.clear()  # opened again in each loader process

    def _labels(self, path: str, file, column: str, names, num_classes) -> np.ndarray:
        """A file's label column as class indices, checked (``labels.arrow_class_indices``)
        after its decompressed size is (``bounds.check_read``)."""
        meta = file.metadata
        bounds.check_read(meta, path, range(meta.num_row_groups),
                          bounds.leaf_columns(meta, column), self.max_decompressed)  # fmt: skip
        read = lambda: file.read(columns=[column]).column(0).combine_chunks()  # noqa: E731
        array = self._with_retries(path, "its labels", read)
        limit = (len(names), "the class names the file declares") if names is not None else None
        if limit is None and num_classes is not None:
            limit = (num_classes, "MODEL.NUM_CLASSES")
        where = printable_path(path)
        return labels.arrow_class_indices(array, names, limit, lambda i: f"row {i} of {where}")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}, "_kept": OrderedDict()}

    def __len__(self) -> int:
        return len(self.labels)

    def _parquet(self, path: str):
        key = (os.getpid(), path)
        if key not in self._open:
            self._open[key] = self._with_retries(path, "its footer", lambda: self._opened(path))
        return self._open[key]

    def _opened(self, path: str):
        f = remote_files.open_file(path, retries=self.retries)
        try:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            checked = bounds.CheckedFile(f, path, self.max_decompressed)
            file = _pq().ParquetFile(checked)
            checked.watch(_chunks(file.metadata))  # every page checked as pyarrow reads it
            file.size = size
            return file
        except bounds.DecompressionBoundError:
            f.close()
            raise
        except Exception as err:  # noqa: BLE001 (pyarrow's ArrowInvalid and friends)
            f.close()
            if (
                "magic bytes" in str(err)
                or "Parquet" in type(err).__name__
                or not (remote_files.is_url(path))
            ):
                raise CorruptFileError(
                    f"{printable_path(path)} is not a readable parquet file "
                    f"({' '.join(str(err).split())})"
                ) from None
            raise

    def _with_retries(self, path: str, what: str, read):
        attempts = self.retries if remote_files.is_url(path) else 1
        last = None
        for _ in range(max(1, attempts)):
            try:
                return read()
            except CorruptFileError:
                raise
            except Exception as err:  # noqa: BLE001 (transport errors of any file system)
                last = err
                self._open.pop((os.getpid(), path), None)
        if not remote_files.is_url(path) and not isinstance(last, OSError):
            raise CorruptFileError(
                f"cannot read {what} in {printable_path(path)}: {' '.join(str(last).split())}"
            ) from None
        raise remote_files.DataReadError(
            f"cannot read {what} in {printable_path(path)} after {max(1, attempts)} attempts: "
            f"{type(last).__name__}: {' '.join(str(last).split())}"
        )

    def _locate(self, index: int) -> tuple[int, int, int]:
        """(file, row group, row in it) of sample ``index``."""
        f = int(np.searchsorted(self._file_starts, index, side="right") - 1)
        row = index - int(self._file_starts[f])
        g = int(np.searchsorted(self._group_starts[f], row, side="right") - 1)
        return f, g, row - int(self._group_starts[f][g])

    def _row_group(self, f: int, g: int):
        key = (os.getpid(), f, g)
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        path, column = self.files[f], self._columns[f][0]
        image = self._leaves[f][0]
        bounds.check_read(self._parquet(path).metadata, path, [g], image, self.max_decompressed,
                          self.max_ratio, image=image)  # fmt: skip

        def read():
            table = self._parquet(path).read_row_group(g, columns=[column])
            images = table.column(0).combine_chunks()
            return images.field("bytes") if hasattr(images, "field") else images

        images = self._with_retries(path, f"row group {g}", read)
        self._kept[key] = images
        while len(self._kept) > _KEPT_ROW_GROUPS:
            self._kept.popitem(last=False)
        return images

    def member(self, index: int) -> str:
        f, _, _ = self._locate(index)
        return f"row {index - int(self._file_starts[f])} of {printable_path(self.files[f])}"

    def encoded(self, index: int) -> bytes:
        f, g, row = self._locate(index)
        value = self._row_group(f, g)[row].as_py() or b""
        # Decompressed with its page: checked before it is decoded
        if why := too_many_bytes(len(value), self.max_pixels):
            raise CorruptImageError(f"refusing image {self.member(index)}: {why}")
        return value

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = decode_image(self.encoded(index), self.member(index), self.max_pixels)
        return image, int(self.labels[index])

    def load_many(self, indices: list[int]) -> list:
        """The samples ``indices`` (a corrupt one as its CorruptImageError), each row group
        read once."""
        # Row groups are kept per process: reading in index order reads each one once
        encoded = {}
        for i in sorted(set(indices)):
            try:
                encoded[i] = self.encoded(i)
            except CorruptImageError as err:
                encoded[i] = err
        out = []
        for index in indices:
            try:
                if isinstance(encoded[index], CorruptImageError):
                    raise encoded[index]
                image = decode_image(encoded[index], self.member(index), self.max_pixels)
            except CorruptImageError as err:
                out.append(err)
            else:
                out.append((image, int(self.labels[index])))
        return out
