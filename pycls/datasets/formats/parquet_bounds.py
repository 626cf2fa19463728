"""What a parquet file may decompress to, checked before pyarrow decompresses it.

A parquet file says how large each part of it is once decompressed: the footer per column chunk
(``total_uncompressed_size``), each page in its header (``uncompressed_page_size``, what pyarrow
allocates and decompresses into). A 29 KB file can hold one zstd page of 700 MB. Here, before a
row group is read:

- the footer: its row counts add up, every column chunk read lies inside the file and holds one
  value per row (``check_footer``);
- the column chunks read: their declared decompressed size is at most ``max_bytes``
  (DATA_LOADER.MAX_DECOMPRESSED_BYTES) for one read, and an image column's at most
  ``max_ratio`` (DATA_LOADER.MAX_COMPRESSION_RATIO) times its stored size, images being stored
  compressed already (``check_read``);
- every page, as its bytes arrive: its header's decompressed size, each at most the limit and
  all together at most what the footer declared for their chunk (``CheckedFile``: the file
  object pyarrow reads through, which walks the page headers of every chunk in the bytes pyarrow
  asked for, so no byte is read twice; for a file held whole in memory, a URL's file read
  whole, ``check_held`` walks the chunks about to be read before pyarrow does).

A failure is a ``DecompressionBoundError`` naming the file, row group, column and sizes.
"""

import io

from pycls.checkpoint.files import CorruptFileError
from pycls.errors import printable_path

# Below this many declared bytes a column chunk is not held to the ratio (small chunks of
# labels, file names or tiny images compress by any ratio and cost nothing)
RATIO_FLOOR = 1 << 20
# How deep thrift structures nest in a page header (a PageHeader holds one level of structs;
# statistics one more)
_MAX_DEPTH = 8


class DecompressionBoundError(CorruptFileError):
    """A parquet file would decompress to more than its limit, or declares sizes that do not
    add up; the message names the file, the part and the sizes."""


def leaf_columns(meta, name: str) -> list[int]:
    """The indices of the leaf columns that make up top-level column ``name`` (a struct such as
    Hugging Face's image ``{bytes, path}`` has several)."""
    schema = meta.schema
    return [i for i in range(schema.__len__()) if schema.column(i).path.split(".")[0] == name]


def chunk_span(column) -> tuple[int, int]:
    """(first byte, stored bytes) of a column chunk: from its dictionary page where it has one."""
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    return start, column.total_compressed_size


def check_footer(meta, path: str, file_size: int, columns: list[int]) -> None:
    """The footer's counts against each other and the file: the rows of the row groups add up
    to the file's, and every chunk of ``columns`` lies inside the file with one value per row."""
    where = printable_path(path)
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    rows = [g.num_rows for g in groups]
    if any(n < 0 for n in rows) or sum(rows) != meta.num_rows:
        raise DecompressionBoundError(
            f"{where}: its footer's row groups hold {sum(rows)} rows, the file declares "
            f"{meta.num_rows} (a damaged or crafted footer)"
        )
    for g, group in enumerate(groups):
        for i in columns:
            column = group.column(i)
            start, stored = chunk_span(column)
            if start < 4 or stored < 0 or start + stored > file_size:
                raise DecompressionBoundError(
                    f"{where}: row group {g}, column {column.path_in_schema}: its bytes "
                    f"{start}-{start + stored} lie outside the file's {file_size}"
                )
            if column.num_values != group.num_rows:
                raise DecompressionBoundError(
                    f"{where}: row group {g}, column {column.path_in_schema}: "
                    f"{column.num_values} values for {group.num_rows} rows"
                )


def check_read(meta, path, groups, columns, max_bytes, max_ratio=0, image=()) -> None:
    """Before row groups ``groups`` of ``columns`` are read: what their chunks declare they
    decompress to, at most ``max_bytes`` together (values are 8 bytes a row at least: the
    offsets of binary values, an int64 label), and for the chunks of ``image`` at most
    ``max_ratio`` times their stored bytes (0: no ratio)."""
    where, total = printable_path(path), 0
    for g in groups:
        group = meta.row_group(g)
        for i in columns:
            column = group.column(i)
            declared = max(column.total_uncompressed_size, 8 * group.num_rows)
            total += declared
            stored = max(column.total_compressed_size, 1)
            bomb = declared > RATIO_FLOOR and declared > max_ratio * stored
            if i in image and max_ratio and bomb:
                raise DecompressionBoundError(
                    f"{where}: row group {g}, column {column.path_in_schema} would decompress "
                    f"from {stored:,} to {declared:,} bytes, {declared / stored:,.0f} times "
                    f"(DATA_LOADER.MAX_COMPRESSION_RATIO {max_ratio:g}: images are stored "
                    "compressed already; a decompression bomb?)"
                )
    if total > max_bytes:
        what = f"row group {groups[0]}" if len(groups) == 1 else f"its {len(groups)} row groups"
        raise DecompressionBoundError(
            f"{where}: {what} would decompress to {total:,} bytes, more than "
            f"DATA_LOADER.MAX_DECOMPRESSED_BYTES {max_bytes:,} (a decompression bomb, or row "
            "groups to write smaller or a limit to raise)"
        )


# ------------------------------------------------------------------------------------------------ #
# Page headers: thrift's compact protocol, as parquet writes them
# ------------------------------------------------------------------------------------------------ #


class _Thrift:
    """Reads thrift compact-protocol values from ``data`` at ``pos``; raises ValueError when the
    bytes end or nest too deep."""

    def __init__(self, data, pos: int):
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ValueError("the header ends early")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        out = shift = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 70:
                raise ValueError("a number longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, kind: int, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise ValueError("structures nested too deep")
        if kind in (1, 2):  # a boolean in a field header
            return
        if kind == 3:
            self.byte()
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.pos += 8
        elif kind == 8:
            length = self.varint()  # read before pos is: the length moves it
            self.pos += length
        elif kind in (9, 10):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(size):
                self.skip_element(head & 0x0F, depth + 1)
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip_element(types >> 4, depth + 1)
                    self.skip_element(types & 0x0F, depth + 1)
        elif kind == 12:
            self.fields(depth + 1)
        else:
            raise ValueError(f"unknown thrift type {kind}")
        if self.pos > len(self.data):
            raise ValueError("the header ends early")

    def skip_element(self, kind: int, depth: int) -> None:
        if kind in (1, 2):  # a boolean in a list is a byte of its own
            self.byte()
        else:
            self.skip(kind, depth)

    def fields(self, depth: int, wanted=()) -> dict:
        """Reads a struct's fields; returns the integer ones of ids ``wanted``."""
        out, field = {}, 0
        while True:
            head = self.byte()
            if head == 0:
                return out
            kind, delta = head & 0x0F, head >> 4
            field = field + delta if delta else self.zigzag()
            if field in wanted and kind in (4, 5, 6):
                out[field] = self.zigzag()
            else:
                self.skip(kind, depth)


def page_header(data, pos: int) -> tuple[int, int, int]:
    """(header length, stored bytes, decompressed bytes) of the page header at ``pos`` of
    ``data``; ValueError when it is not one."""
    reader = _Thrift(data, pos)
    fields = reader.fields(0, wanted=(2, 3))
    if 2 not in fields or 3 not in fields:
        raise ValueError("no page sizes")
    uncompressed, compressed = fields[2], fields[3]
    if uncompressed < 0 or compressed < 0:
        raise ValueError("negative page sizes")
    return reader.pos - pos, compressed, uncompressed


class Chunk:
    """A column chunk pyarrow will read: where it lies and what the footer says of it."""

    def __init__(self, start, stored, declared, what):
        self.start, self.stored, self.declared, self.what = start, stored, declared, what


def check_pages(data, chunk: Chunk, max_bytes: int, path: str) -> None:
    """Walks the page headers of ``chunk`` (``data``: its stored bytes): each page decompresses
    to at most ``max_bytes``, and all of them to at most what the footer declared."""
    pos, total = 0, 0
    where = f"{printable_path(path)}: {chunk.what}"
    while pos < len(data):
        try:
            length, stored, decompressed = page_header(data, pos)
        except ValueError as err:
            raise DecompressionBoundError(
                f"{where}: no readable page header at byte {chunk.start + pos} ({err})"
            ) from None
        total += length + decompressed
        if decompressed > max_bytes or total > chunk.declared:
            raise DecompressionBoundError(
                f"{where}: a page at byte {chunk.start + pos} would decompress to "
                f"{decompressed:,} bytes; its chunk declares {chunk.declared:,} in all, and "
                f"DATA_LOADER.MAX_DECOMPRESSED_BYTES is {max_bytes:,} (a crafted page header)"
            )
        pos += length + stored


def check_held(data, chunks, max_bytes: int, path: str) -> None:
    """``check_pages`` of ``chunks`` in a file held whole in memory (``data``)."""
    for chunk in chunks:
        check_pages(data[chunk.start : chunk.start + chunk.stored], chunk, max_bytes, path)


class CheckedFile(io.RawIOBase):
    """The file object pyarrow reads a parquet file through: the bytes of every registered
    column chunk (``watch``) are checked by ``check_pages`` before pyarrow sees them. pyarrow
    reads a chunk in one piece; a read that holds only part of a chunk has that chunk's headers
    read first, from the file."""

    def __init__(self, raw, path: str, max_bytes: int):
        self.raw, self.path, self.max_bytes = raw, path, max_bytes
        self._chunks: dict[int, Chunk] = {}
        self._checked: set[int] = set()

    def watch(self, chunks) -> None:
        for chunk in chunks:
            self._chunks.setdefault(chunk.start, chunk)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def read(self, size: int = -1) -> bytes:
        start = self.raw.tell()
        data = self.raw.read(size)
        end = start + len(data)
        for chunk in self._chunks.values():
            if chunk.start in self._checked:
                continue
            if chunk.start >= end or chunk.start + chunk.stored <= start:
                continue
            if start <= chunk.start and chunk.start + chunk.stored <= end:
                offset = chunk.start - start
                check_pages(memoryview(data)[offset : offset + chunk.stored], chunk,
                            self.max_bytes, self.path)  # fmt: skip
            else:
                self._check_from_file(chunk, end)
            self._checked.add(chunk.start)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _check_from_file(self, chunk: Chunk, back: int) -> None:
        self.raw.seek(chunk.start)
        check_pages(self.raw.read(chunk.stored), chunk, self.max_bytes, self.path)
        self.raw.seek(back)

    def close(self) -> None:
        self.raw.close()
        super().close()
