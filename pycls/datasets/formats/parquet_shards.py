"""Hugging Face datasets' parquet files (the Hub's ``imagenet-1k``, timm's ``hfds/``), read by
sample index through pyarrow: ``ParquetShards``.

A sample is a row: its image in the ``image`` column (the Hub's Image feature, a struct of
``bytes`` and ``path``, or plain binary; ``img``, ``jpg`` and ``png`` are also looked for) and its
class in ``label`` (or ``labels``, ``fine_label``, ``cls``). The class names come from the
file's ``huggingface`` schema metadata (a ClassLabel feature) where it has them.

A row may hold its image's path and no bytes: ``datasets`` writes local image files so
(``Dataset.from_dict({"image": paths, ...}, features=...).to_parquet(...)``). The path is read under
a rule of trust, since a parquet file is data that anyone may have written: it names only files
below its own folder. At a URL, a relative path read from the same server (never another host,
``file://`` or a ``..`` that climbs out, also written as ``%2e%2e``: the path is compared decoded,
``pycls.datasets.transport.url_paths``); on disk, a path relative to the folder or an absolute one,
that lies below the folder once ``..`` and links are resolved (``image_paths="below"``,
DATA_LOADER.IMAGE_PATHS). ``image_paths="any"`` lets a local parquet file name any file the user can
read (a file one wrote oneself, naming images elsewhere). A row whose path breaks the rule, or names
nothing, is refused as a corrupt image naming the row and the path.

Parquet is read by row group: a sample's image is read with the other rows of its row group, and
each loader process keeps the last few row groups it read. Orders that read the files shard by
shard (DATA_LOADER.ORDER shards, each process a run of consecutive samples) read a row group
about once; a global random order reads one per sample. Opening reads each file's footer and its
label column only. A file that is not parquet, or lacks the columns, is refused in one line
naming it; an image that does not decode is a ``CorruptImageError`` naming the file and row.
A file at a URL is read as it was opened: its reads carry the validator its server gave then
(ETag / Last-Modified) and must state its size, so one replaced since answers 412 and each row
read from it is a corrupt image naming the file (skipped under DATA_LOADER.SKIP_CORRUPT).
"""

import contextlib
import json
import os
from collections import OrderedDict
from urllib.parse import quote, urljoin, urlsplit

import numpy as np
import torch
from torch.utils.data import Dataset

from pycls.checkpoint.files import CorruptFileError
from pycls.datasets.formats import labels
from pycls.datasets.formats import parquet_bounds as bounds
from pycls.datasets.formats.image_header import DEFAULT_MAX_PIXELS, too_many_bytes
from pycls.datasets.formats.imagefolder import CorruptImageError, read_image_bytes
from pycls.datasets.formats.reader_settings import IMAGE_PATH_RULES
from pycls.datasets.formats.tar_shards import decode_image
from pycls.datasets.transport import remote_files, url_paths
from pycls.datasets.transport.read_errors import without_secrets
from pycls.errors import WaitStopped, printable_path

IMAGE_COLUMNS = ("image", "img", "jpg", "png")
LABEL_COLUMNS = ("label", "labels", "fine_label", "cls")
# Row groups each loader process keeps (one batch of a shard-wise order spans one or two)
_KEPT_ROW_GROUPS = 4
# The most an image named by its path in a parquet file at a URL may hold
_MAX_LINKED_IMAGE = 256 << 20
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


def _chunks(meta, groups=None, columns=None) -> list:
    """The column chunks of the file (of row groups ``groups`` and leaf columns ``columns``
    where given), for the page checks (only those read are checked)."""
    out = []
    for g in range(meta.num_row_groups) if groups is None else groups:
        group = meta.row_group(g)
        for i in range(group.num_columns) if columns is None else columns:
            column = group.column(i)
            start, stored = bounds.chunk_span(column)
            what = f"row group {g}, column {column.path_in_schema}"
            out.append(bounds.Chunk(start, stored, column.total_uncompressed_size, what))
    return out


class ParquetShards(Dataset):
    """Raw ``(uint8 (3, H, W), label)`` samples of parquet files (paths or URLs), row after row.

    Attributes: ``labels``, ``shard_sizes`` (rows per file), ``num_classes`` and ``classes``
    (the ClassLabel names where recorded, else the largest label + 1 and None), ``folder``,
    ``serves_ranges`` (False for files at a URL whose server answers no byte ranges: each is
    read whole, when it fits ``access.readahead_bytes``; larger ones are refused).

    ``access`` and ``window`` as for ``TarShards``: files at a URL are read whole, and kept,
    when the files a batch draws from fit the read-ahead bound; else by row group.
    ``image_paths``: where a local file's rows may name images by path (the module's rule).
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
        num_classes: int | None = None,
        max_decompressed: int = MAX_DECOMPRESSED_BYTES,
        max_ratio: float = MAX_COMPRESSION_RATIO,
        image_paths: str = "below",
    ):
        if not files:
            raise ValueError("no parquet files to read")
        if image_paths not in IMAGE_PATH_RULES:
            raise ValueError(f"image_paths must be one of {IMAGE_PATH_RULES}, got {image_paths!r}")
        self.image_paths, self._roots = image_paths, {}  # a folder -> where its links lead
        self.files, self.max_pixels, self.retries = list(files), max_pixels, retries
        self.folder, self.max_decompressed, self.max_ratio = where, max_decompressed, max_ratio
        self._reader = remote_files.RangeReader(retries, access)
        self.serves_ranges = True
        self._open: dict = {}
        self._kept: OrderedDict = OrderedDict()
        self._footers: dict = {}
        if remote_files.is_url(self.files[0]):
            self._ask_server(access)
        labels, group_rows, columns, self._leaves, names = [], [], [], [], None
        for path in self.files:
            file = self._parquet(path)
            meta, schema = file.metadata, file.schema_arrow
            self._footers[path] = meta
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
        self._plan_reads(window)
        self._open.clear()  # opened again in each loader process

    def _labels(self, path: str, file, column: str, names, num_classes) -> np.ndarray:
        """A file's label column as class indices, checked (``labels.arrow_class_indices``)
        after its decompressed size is (``bounds.check_read``)."""
        meta = file.metadata
        groups, leaves = range(meta.num_row_groups), bounds.leaf_columns(meta, column)
        bounds.check_read(meta, path, groups, leaves, self.max_decompressed)
        self._check_pages(file, path, groups, leaves)
        read = lambda: file.read(columns=[column]).column(0).combine_chunks()  # noqa: E731
        array = self._with_retries(path, "its labels", read)
        limit = (len(names), "the class names the file declares") if names is not None else None
        if limit is None and num_classes is not None:
            limit = (num_classes, "MODEL.NUM_CLASSES")
        where = printable_path(path)
        return labels.arrow_class_indices(array, names, limit, lambda i: f"row {i} of {where}")

    def _ask_server(self, access) -> None:
        """The sizes of a URL's files and whether their server serves byte ranges; without them
        each file is read whole, which it must fit (see the class)."""
        reader, retries = self._reader, self.retries
        reader.sizes = {p: remote_files.file_size(p, retries, access) for p in self.files}
        # Every read is held to the file as it was opened (its validator and size)
        reader.conditions = {
            p: remote_files.file_conditions(p, retries, access) for p in self.files
        }
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

    def _check_pages(self, file, path: str, groups, columns) -> None:
        """The page headers of what is about to be read, where the file is held whole in memory
        (a file read by ranges has them checked as they arrive: ``bounds.CheckedFile``)."""
        held = getattr(file, "held", None)
        if held is not None:
            chunks = _chunks(file.metadata, groups, columns)
            bounds.check_held(memoryview(held), chunks, self.max_decompressed, path)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}, "_kept": OrderedDict()}

    def __len__(self) -> int:
        return len(self.labels)

    def _whole(self, path: str) -> bool:
        return remote_files.is_url(path) and self._reader.whole_files

    def _parquet(self, path: str):
        if self._whole(path):  # from the bytes this process keeps, not held open
            data = self._reader.whole(path)
            file = _pq().ParquetFile(_pa().BufferReader(data), metadata=self._footers.get(path))
            file.size, file.held = len(data), data  # its pages checked before a read
            return file
        key = (os.getpid(), path)
        if key not in self._open:
            self._open[key] = self._with_retries(path, "its footer", lambda: self._opened(path))
        return self._open[key]

    def _opened(self, path: str):
        reader = self._reader
        f = remote_files.open_file(path, self.retries, reader.access, size=reader.sizes.get(path),
                                   conditions=reader.conditions.get(path))  # fmt: skip
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
            except (CorruptFileError, remote_files.DataPathError, remote_files.DataReadError,
                    remote_files.DataChangedError, WaitStopped):  # fmt: skip
                raise  # named already; a read of the file was retried already
            except Exception as err:  # noqa: BLE001 (transport errors of any file system)
                last = err
                self._open.pop((os.getpid(), path), None)
        said = without_secrets(" ".join(str(last).split()))
        if not remote_files.is_url(path) and not isinstance(last, OSError):
            raise CorruptFileError(
                f"cannot read {what} in {printable_path(path)}: {said}"
            ) from None
        raise remote_files.DataReadError(
            f"cannot read {what} in {printable_path(path)} after {max(1, attempts)} attempts: "
            f"{type(last).__name__}: {said}"
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
        image = self._leaves[f][0]
        bounds.check_read(self._footers[path], path, [g], image, self.max_decompressed,
                          self.max_ratio, image=image)  # fmt: skip

        def read():
            file = self._parquet(path)
            self._check_pages(file, path, [g], image)
            table = file.read_row_group(g, columns=[column])
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
        try:
            data, paths = self._row_group(f, g)
        except remote_files.DataChangedError as err:  # a corrupt sample: skippable, and named
            raise CorruptImageError(f"cannot read image {self.member(index)}: {err}") from None
        value = data[row].as_py()
        if not value and paths is not None and (path := paths[row].as_py()):
            value = self._linked_image(index, f, path)
        value = value or b""
        # Decompressed with its page (or named by its path): checked before it is decoded
        if why := too_many_bytes(len(value), self.max_pixels):
            raise CorruptImageError(f"refusing image {self.member(index)}: {why}")
        return value

    def _linked_image(self, index: int, f: int, path: str) -> bytes:
        """The bytes of the image a row names by ``path`` (and holds no bytes of), under the
        rule of trust in the module's docstring; CorruptImageError naming the row otherwise. A
        file larger than any image within the pixel limit is not read."""
        where = f"image {self.member(index)}: it holds a path and no bytes"
        source = self.files[f]
        if not remote_files.is_url(source):
            folder = os.path.dirname(os.path.abspath(remote_files.local_path(source)))
            if "://" in path:
                raise CorruptImageError(
                    f"refusing {where}, and {printable_path(path)} is a URL: a parquet file names "
                    "image files by their path"
                )
            target = self._local_target(folder, path, where)
            with contextlib.suppress(OSError):  # a file that is not there: said by the read
                self._check_linked_size(where, target, os.stat(target).st_size)
            try:
                data = read_image_bytes(target, 0)
            except CorruptImageError as err:
                raise CorruptImageError(f"cannot read {where}; {err}") from None
            return data.numpy().tobytes()
        url = self._linked_url(source, path, where)
        reader = self._reader
        try:
            size = reader.size(url)
            if size > _MAX_LINKED_IMAGE:
                raise CorruptImageError(f"refusing {where}, and {url} holds {size} bytes")
            self._check_linked_size(where, url, size)
            return reader.read(url, 0, size, "the image it names") if size else b""
        except remote_files.DataPathError as err:
            raise CorruptImageError(f"cannot read {where}; {err}") from None

    def _local_target(self, folder: str, path: str, where: str) -> str:
        """The file a local parquet file's row names: ``path`` against its folder, held below
        it (``..`` and links resolved) unless ``image_paths`` is "any"."""
        target = os.path.join(folder, path)
        if self.image_paths == "any":
            return target
        root = self._roots.get(folder) or self._roots.setdefault(folder, os.path.realpath(folder))
        real = os.path.realpath(target)
        if os.path.commonpath([real, root]) != root or real == root:
            shown = printable_path(path)
            if real != path:
                shown += f" (which leads to {printable_path(real)})"
            raise CorruptImageError(
                f"refusing {where}, and {shown} is not below its folder {printable_path(root)}: "
                "a parquet file may name only files below its own folder (no absolute path "
                "elsewhere, '..' or link that leads out); DATA_LOADER.IMAGE_PATHS any lets a "
                "parquet file you wrote yourself name any file you can read"
            )
        return real

    def _check_linked_size(self, where: str, target: str, size: int) -> None:
        if why := too_many_bytes(size, self.max_pixels):
            raise CorruptImageError(f"refusing {where}, and {printable_path(target)}: {why}")

    @staticmethod
    def _linked_url(source: str, path: str, where: str) -> str:
        """The URL of a relative ``path`` under the folder of the parquet file at ``source``,
        held below it as the server will read it (decoded: ``%2e%2e`` climbs as ``..`` does)."""
        parts = urlsplit(path)
        folder = source.rsplit("/", 1)[0] + "/"
        url = None
        if not (parts.scheme or parts.netloc or path.startswith(("/", "\\"))):
            relative = quote(path.replace("\\", "/"), safe="/%:@!$&'()*+,;=-._~")
            url = url_paths.below(folder, urljoin(folder, relative))
        if url is None:
            raise CorruptImageError(
                f"refusing {where}, and {printable_path(path)} is not a relative path under its "
                "folder: a parquet file at a URL may name only files below its own folder on the "
                "same server (no absolute path, other host, file:// or '..' climbing out)"
            )
        return url

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
