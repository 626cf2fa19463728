"""Every decompression has a bound (pycls.datasets.formats.parquet_bounds): what a parquet row
group's column chunks declare is checked against DATA_LOADER.MAX_DECOMPRESSED_BYTES and
MAX_COMPRESSION_RATIO before pyarrow reads them, every page header as its bytes arrive, the footer's
row counts against each other; a decompressed cell, and a tar member before it is read, against what
an image within DATA_LOADER.MAX_IMAGE_PIXELS can take. Small files and small limits: a bomb of 4 MB
stands for one of 700 MB."""

import io
import tarfile

import pytest
import torch
from torchvision.io import encode_png

from pycls.core import cli
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.formats.parquet_bounds import DecompressionBoundError, _Thrift
from pycls.datasets.formats.parquet_shards import ParquetShards
from pycls.datasets.formats.tar_shards import TarShards
from tests.helpers import QUICKSTART, TINY
from tests.helpers.data_servers import NoRangeHandler, RangeHandler, Server

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

BOMB = 4 << 20  # zeros: zstd stores them in a few hundred bytes


def _png(value=0):
    return encode_png(torch.full((3, 4, 4), value, dtype=torch.uint8)).numpy().tobytes()


def _parquet(path, cells, **options):
    table = pa.table({"image": pa.array(cells, pa.binary()), "label": list(range(len(cells)))})
    pq.write_table(table, path, compression="zstd", **options)
    return str(path)


def test_a_bomb_row_group_is_refused_before_it_is_decompressed(tmp_path):
    path = _parquet(tmp_path / "bomb.parquet", [_png(), bytes(BOMB)])
    assert (tmp_path / "bomb.parquet").stat().st_size < 20_000
    shards = ParquetShards([path], max_decompressed=1 << 20, max_ratio=0)  # the labels are small
    with pytest.raises(DecompressionBoundError) as err:
        shards.encoded(0)
    line = str(err.value)
    assert line.startswith(f"{path}: row group 0 would decompress to 4,") and "\n" not in line
    assert "more than DATA_LOADER.MAX_DECOMPRESSED_BYTES 1,048,576" in line
    # Under the default limit, the ratio refuses it (images are stored compressed already)
    with pytest.raises(DecompressionBoundError, match="MAX_COMPRESSION_RATIO 100"):
        ParquetShards([path]).encoded(0)


def test_a_cell_larger_than_any_image_within_the_pixel_limit_is_refused_as_corrupt(tmp_path):
    path = _parquet(tmp_path / "bomb.parquet", [_png(), bytes(BOMB)])
    shards = ParquetShards([path], max_ratio=0, max_pixels=100)
    assert shards[0][0].shape == (3, 4, 4)
    with pytest.raises(CorruptImageError, match=f"refusing image row 1 of {path}: it holds 4,"):
        shards[1]
    (good, bad) = shards.load_many([0, 1])  # the batched read: the bad one is its error
    assert good[1] == 0 and isinstance(bad, CorruptImageError)


def _first_page_size_at(data, chunk_start):
    """Where the decompressed size (field 2) of the page header at ``chunk_start`` is stored,
    and its bytes: fields 1 and 2 are i32s, each a field byte and a varint."""
    reader = _Thrift(data, chunk_start + 1)
    reader.varint()  # the page type
    start = reader.pos + 1
    reader.pos = start
    reader.varint()
    return start, reader.pos - start


def _crafted(path):
    """A parquet file with a crafted page header: its chunk declares 20 KB, the page 1 MB (what
    pyarrow would allocate and decompress into)."""
    _parquet(path, [_png(), torch.randint(0, 256, (20_000,), dtype=torch.uint8).numpy().tobytes()],
             use_dictionary=False)  # fmt: skip
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    data = bytearray(path.read_bytes())
    at, width = _first_page_size_at(data, column.data_page_offset)
    assert width == 3  # 20 KB; rewritten as 1 MB, the same length
    data[at : at + 3] = b"\xfe\xff\x7f"
    path.write_bytes(bytes(data))
    return path


def test_a_page_header_claiming_more_than_its_chunk_is_refused_before_pyarrow_reads_it(tmp_path):
    path = _crafted(tmp_path / "crafted.parquet")
    shards = ParquetShards([str(path)], max_decompressed=256 << 10)
    with pytest.raises(DecompressionBoundError) as err:
        shards.encoded(0)
    line = str(err.value)
    assert line.startswith(f"{path}: row group 0, column image: a page at byte 4 would ")
    assert "decompress to 1,048,575 bytes; its chunk declares 20," in line


@pytest.mark.parametrize("handler", [RangeHandler, NoRangeHandler])
def test_a_crafted_page_at_a_url_read_whole_is_refused_before_pyarrow_reads_it(tmp_path, handler):
    """A file at a URL read whole (kept within DATA_LOADER.READAHEAD_MB, or from a server without
    byte ranges) is read by pyarrow from memory: its pages are checked there too."""
    _crafted(tmp_path / "crafted.parquet")
    with Server(tmp_path, handler) as server:
        url = server.url("crafted.parquet")
        shards = ParquetShards([url], max_decompressed=256 << 10, window=None)
        assert shards._reader.whole_files  # a random order over 1 small file: read whole
        with pytest.raises(DecompressionBoundError) as err:
            shards.encoded(0)
    line = str(err.value)
    assert line.startswith(f"{url}: row group 0, column image: a page at byte 4 would ")


def test_footer_row_counts_that_do_not_add_up_are_refused(tmp_path):
    path = tmp_path / "footer.parquet"
    _parquet(path, [_png(n) for n in range(5)])
    data = bytearray(path.read_bytes())
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    reader, field = _Thrift(data, start), 0
    while field != 3:  # FileMetaData's num_rows
        head = reader.byte()
        field += head >> 4
        if field != 3:
            reader.skip(head & 0x0F, 0)
    assert data[reader.pos] == 10  # 5, zigzag
    data[reader.pos] = 12  # 6: pyarrow reads it without a word
    path.write_bytes(bytes(data))
    assert pq.ParquetFile(path).metadata.num_rows == 6
    with pytest.raises(DecompressionBoundError, match="hold 5 rows, the file declares 6"):
        ParquetShards([str(path)])


def test_a_tar_member_larger_than_any_image_is_not_read(tmp_path):
    path = tmp_path / "train-000000.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("a.png", _png()), ("a.cls", b"0"), ("b.png", bytes(BOMB)),
                           ("b.cls", b"1")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    shards = TarShards([str(path)], cache_dir=tmp_path / "ix", max_pixels=100)
    read = []
    ranges = lambda requests: [(start, size) for _, start, size, _ in requests]  # noqa: E731
    cut = lambda requests: [path.read_bytes()[s : s + n] for _, s, n, _ in requests]  # noqa: E731
    shards._reader.read_batch = lambda r: read.append(ranges(r)) or cut(r)
    with pytest.raises(CorruptImageError, match="refusing image b.png of shard .* it holds 4,"):
        shards.encoded(1)
    got = shards.load_many([0, 1])
    # a.png is read with its header (the 512 bytes before it), b.png not at all
    assert isinstance(got[1], CorruptImageError) and read == [[(0, 512 + len(_png()))]]
    assert got[0][0].shape == (3, 4, 4)


_TRAIN = [*TINY, "TRAIN.BATCH_SIZE", "2", "TEST.BATCH_SIZE", "2", "OPTIM.MAX_EPOCH", "1",
          "MODEL.NUM_CLASSES", "4", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]  # fmt: skip


def test_cli_a_bomb_stops_in_one_line_with_exit_2(tmp_path, capsys):
    cells = [_png(), bytes(BOMB), _png(), _png()]
    path = _parquet(tmp_path / "train-00000-of-00001.parquet", cells)
    status = cli.main(["--mode", "train", "--cfg", QUICKSTART, *_TRAIN, "DATA.PATH", path,
                       "DATA.TEST_PATH", path, "OUT_DIR", str(tmp_path / "out"),
                       "DATA_LOADER.NUM_WORKERS", "0"])  # fmt: skip
    # (no loader worker: a run stopped by an error leaves a worker to the process's exit, which
    # a command run in the test's process does not reach)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and line.startswith(f"error: {path}: row group 0, column image"), line
    assert "MAX_COMPRESSION_RATIO" in line
