"""Hugging Face datasets' parquet files (the Hub's ``imagenet-1k``, timm's ``hfds/``), read by
sample index through pyarrow: ``ParquetShards``.

A sample is a row: its image in the ``image`` column (the Hub's Image feature, a struct of
``bytes`` and ``path``, or plain binary; ``img``, ``jpg`` and ``png`` are also looked for) and its
class in ``label`` (or ``labels``, ``fine_label``, ``cls``). The class names come from the
file's ``huggingface`` schema metadata (a ClassLabel feature) where it has them.

A row may hold its image's path and no bytes: ``datasets`` writes local image files so
(``Dataset.from_dict({"image": paths, ...}, features=...).to_parquet(...)``). The path is read
under a rule of trust: a local parquet file may name an absolute path, or one relative to its
own folder; a parquet file at a URL only a relative path under its own folder, read from the
same server (never another host, ``file://`` or a ``..`` that climbs out). A row whose path
breaks the rule, or names nothing, is refused as a corrupt image naming the row and the path.

Parquet is read by row group: a sample's image is read with the other rows of its row group, and
each loader process keeps the last few row groups it read. Orders that read the files shard by
shard (DATA_LOADER.ORDER shards, each process a run of consecutive samples) read a row group
about once; a global random order reads one per sample. Opening reads each file's footer and its
label column only. A file that is not parquet, or lacks the columns, is refused in one line
naming it; an image that does not decode is a ``CorruptImageError`` naming the file and row.
"""

import json
import os
import posixpath
from collections import OrderedDict
from urllib.parse import urljoin, urlsplit

import numpy as np
import torch
from torch.utils.data import Dataset

from pycls.checkpoint.files import CorruptFileError
from pycls.datasets import remote_files
from pycls.datasets.image_header import DEFAULT_MAX_PIXELS
from pycls.datasets.imagefolder import CorruptImageError, read_image_bytes
from pycls.datasets.tar_shards import decode_image
from pycls.errors import printable_path

IMAGE_COLUMNS = ("image", "img", "jpg", "png")
LABEL_COLUMNS = ("label", "labels", "fine_label", "cls")
# Row groups each loader process keeps (one batch of a shard-wise order spans one or two)
_KEPT_ROW_GROUPS = 4
# The most an image named by its path in a parquet file at a URL may hold
_MAX_LINKED_IMAGE = 256 << 20


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


class ParquetShards(Dataset):
    """Raw ``(uint8 (3, H, W), label)`` samples of parquet files (paths or URLs), row after row.

    Attributes: ``labels``, ``shard_sizes`` (rows per file), ``num_classes`` and ``classes``
    (the ClassLabel names where recorded, else the largest label + 1 and None), ``folder``,
    ``serves_ranges`` (False for files at a URL whose server answers no byte ranges: each is
    read whole, when it fits ``access.readahead_bytes``; larger ones are refused).

    ``access`` and ``window`` as for ``TarShards``: files at a URL are read whole, and kept,
    when the files a batch draws from fit the read-ahead bound; else by row group.
    """

    def __init__(
        self,
        files: list[str],
        *,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        retries: int = 3,
        where: str = "",
        access: remote_files.Access | None = None,
        window: int | None = 0,
    ):
        if not files:
            raise ValueError("no parquet files to read")
        self.files, self.max_pixels, self.retries = list(files), max_pixels, retries
        self.folder = where
        self._reader = remote_files.RangeReader(retries, access)
        self.serves_ranges = True
        self._open: dict = {}
        self._kept: OrderedDict = OrderedDict()
        self._footers: dict = {}
        if remote_files.is_url(self.files[0]):
            self._ask_server(access)
        labels, group_rows, columns, names = [], [], [], None
        for path in self.files:
            meta = self._parquet(path)
            self._footers[path] = meta.metadata
            schema = meta.schema_arrow
            image = _one_of(schema.names, IMAGE_COLUMNS, path, "image")
            label = _one_of(schema.names, LABEL_COLUMNS, path, "label")
            columns.append((image, label))
            names = names or hf_class_names(schema, label)
            groups = range(meta.num_row_groups)
            group_rows.append([meta.metadata.row_group(g).num_rows for g in groups])
            labels.append(self._with_retries(path, "its labels", lambda p=meta, c=label: (
                p.read(columns=[c]).column(0).to_numpy(zero_copy_only=False))))  # fmt: skip
        self._columns = columns
        self.shard_sizes = [int(sum(rows)) for rows in group_rows]
        # Per file, the first sample of each of its row groups
        self._group_starts = [np.cumsum([0] + rows[:-1]) for rows in group_rows]
        self._file_starts = np.cumsum([0] + self.shard_sizes[:-1])
        self.labels = torch.from_numpy(np.concatenate(labels).astype(np.int64))
        for path, lab in zip(self.files, labels):
            if len(lab) and (lab.min() < 0):
                raise CorruptFileError(f"{printable_path(path)} has a negative label ({lab.min()})")
        largest = int(self.labels.max()) + 1 if len(self.labels) else 0
        self.classes = names if names is not None and len(names) >= largest else None
        self.num_classes = len(self.classes) if self.classes is not None else largest
        self._plan_reads(window)
        self._open.clear()  # opened again in each loader process

    def _ask_server(self, access) -> None:
        """The sizes of a URL's files and whether their server serves byte ranges; without them
        each file is read whole, which it must fit (see the class)."""
        reader, retries = self._reader, self.retries
        reader.sizes = {p: remote_files.file_size(p, retries, access) for p in self.files}
        self.serves_ranges = remote_files.serves_ranges(self.files[0], access, retries)
        limit = reader.access.readahead_bytes
        if self.serves_ranges:
            return
        path, size = max(reader.sizes.items(), key=lambda item: item[1])
        if size > limit:
            raise remote_files.too_large_without_ranges(path, size, limit)
        reader.whole_files = True

    def _plan_reads(self, window) -> None:
        """Whether a URL's files are read whole: when those a batch draws from fit the bound."""
        reader = self._reader
        if not remote_files.is_url(self.files[0]) or not self.serves_ranges:
            return
        total, largest = sum(reader.sizes.values()), max(reader.sizes.values())
        samples = max(1, len(self))
        drawn = total if window is None else min(total, window * total // samples + 2 * largest)
        reader.whole_files = window != 0 and drawn <= reader.access.readahead_bytes
        self._open.clear()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}, "_kept": OrderedDict()}

    def __len__(self) -> int:
        return len(self.labels)

    def _whole(self, path: str) -> bool:
        return remote_files.is_url(path) and self._reader.whole_files

    def _parquet(self, path: str):
        if self._whole(path):  # from the bytes this process keeps, not held open
            data = self._reader.whole(path)
            return _pq().ParquetFile(_pa().BufferReader(data), metadata=self._footers.get(path))
        key = (os.getpid(), path)
        if key not in self._open:
            self._open[key] = self._with_retries(path, "its footer", lambda: self._opened(path))
        return self._open[key]

    def _opened(self, path: str):
        f = remote_files.open_file(path, self.retries, self._reader.access)
        try:
            return _pq().ParquetFile(f)
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
            except (CorruptFileError, remote_files.DataPathError, remote_files.DataReadError):
                raise  # named already; a read of the file was retried already
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
        """(image bytes, image paths or None) of row group ``g`` of file ``f``."""
        key = (os.getpid(), f, g)
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        path, column = self.files[f], self._columns[f][0]

        def read():
            table = self._parquet(path).read_row_group(g, columns=[column])
            images = table.column(0).combine_chunks()
            if not hasattr(images, "field"):  # plain binary
                return images, None
            names = [images.type.field(i).name for i in range(images.type.num_fields)]
            paths = images.field("path") if "path" in names else None
            return images.field("bytes"), paths

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
        data, paths = self._row_group(f, g)
        value = data[row].as_py()
        if value or paths is None:
            return value or b""
        path = paths[row].as_py()
        return self._linked_image(index, f, path) if path else b""

    def _linked_image(self, index: int, f: int, path: str) -> bytes:
        """The bytes of the image a row names by ``path`` (and holds no bytes of), under the
        rule of trust in the module's docstring; CorruptImageError naming the row otherwise."""
        where = f"image {self.member(index)}: it holds a path and no bytes"
        source = self.files[f]
        if not remote_files.is_url(source):
            folder = os.path.dirname(os.path.abspath(remote_files.local_path(source)))
            if "://" in path:
                raise CorruptImageError(
                    f"refusing {where}, and {printable_path(path)} is a URL: a parquet file names "
                    "image files by their path"
                )
            try:
                data = read_image_bytes(os.path.join(folder, path), 0)
            except CorruptImageError as err:
                raise CorruptImageError(f"cannot read {where}; {err}") from None
            return data.numpy().tobytes()
        url = self._linked_url(source, path, where)
        reader = self._reader
        try:
            size = reader.size(url)
            if size > _MAX_LINKED_IMAGE:
                raise CorruptImageError(f"refusing {where}, and {url} holds {size} bytes")
            return reader.read(url, 0, size, "the image it names") if size else b""
        except remote_files.DataPathError as err:
            raise CorruptImageError(f"cannot read {where}; {err}") from None

    @staticmethod
    def _linked_url(source: str, path: str, where: str) -> str:
        """The URL of a relative ``path`` under the folder of the parquet file at ``source``."""
        parts = urlsplit(path)
        normal = posixpath.normpath(path.replace("\\", "/"))
        if (
            parts.scheme
            or parts.netloc
            or path.startswith(("/", "\\"))
            or normal == ".."
            or (normal.startswith("../"))
        ):
            raise CorruptImageError(
                f"refusing {where}, and {printable_path(path)} is not a relative path under its "
                "folder: a parquet file at a URL may name only files below its own folder on the "
                "same server (no absolute path, other host, file:// or '..' climbing out)"
            )
        return urljoin(source.rsplit("/", 1)[0] + "/", normal)

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
