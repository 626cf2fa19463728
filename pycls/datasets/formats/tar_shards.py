"""WebDataset tar shards (timm's ``wds/`` data sets, ``timm/imagenet-1k-wds``, OpenCLIP's),
read by sample index: ``TarShards``. (Over the house's 600 lines on purpose: the index, the
checks that what is read is what was indexed, and the batched reads all work on one index layout,
which splitting would spread over modules that must change together.)

A sample is the tar members that share a key (WebDataset's rule: the member's path up to the
first dot of its file name), among them an image (``jpg``, ``jpeg``, ``png`` or ``webp``) and a
label (``cls``: the class index as text, or ``json``: an object with ``label`` or ``cls``).
Other members are ignored.

Each shard is indexed once, as wids indexes shards: the standard library's ``tarfile`` walks its
headers (through fsspec for a URL, reading the file in blocks as it goes) and the index records,
per sample, its key, where its image lies in the file and its label. Indexes are kept in a cache
folder, each tied to the shard's size and modification time (ETag for a URL), so a changed shard
is indexed again. With the index a sample is one byte range: pycls's seeded sampler stays the one
source of order, and a resume continues at the exact next sample whatever the order.

What was indexed is what is read. tarfile stops without a word at the end of the file, at a block of
zeros or at a header it cannot read, wherever it meets one; so indexing checks what follows the last
member: a shard that ends without tar's two end-of-archive blocks was cut short (inside a member or
between two), and data after them (two tars written one after the other) would never be read. Where
an ``_info.json`` records the shard's sample count, the index must hold as many. Such a shard is
refused at the start in one line naming it, or, under DATA_LOADER.SKIP_CORRUPT, its whole samples
are read and it is named (the log, ``skipped_files.txt``) with the samples missing. A sample without
an image or a label, with a member written twice, or whose label is no class index
(``pycls.datasets.formats.labels``) is refused naming it. A member larger than any image within the
pixel limit is not read; an image that does not decode is a ``CorruptImageError`` naming the shard
and the member (skipped and listed under DATA_LOADER.SKIP_CORRUPT). A read that fails after its
retries is a ``DataReadError``, never a sample silently left out.

What was indexed is still what is read later in the run (DATA_LOADER.VERIFY_SHARDS). The index
records, per sample, the CRC-32 of the 512-byte tar header before its image and the CRC-32 of
the image's first and last 4 KiB (``ends_digest``), and each image is read with its header (one
range) and both compared (``verify="members"``, the default; ``"headers"`` compares the header
only): a shard rewritten since it was indexed is caught wherever a header or an image read
differs, so a shard replaced behind byte-identical headers never pairs its images with the old
labels. A URL's reads
also carry the validator its server gave when the shard was indexed (If-Match with its ETag, or
If-Unmodified-Since: a changed file answers 412) and must state the size indexed; a shard read
whole is held to both. With ``verify="sha256"`` indexing also records each shard's SHA-256, which
a shard at a URL is held to (it is then always read whole, and hashed before any sample of it is
used) and a local shard's cached index is checked against when the split is opened. A shard
found changed is a ``ShardChangedError`` (a CorruptImageError) for every sample of it this
process reads afterwards: the run stops naming it, or under DATA_LOADER.SKIP_CORRUPT its samples
are skipped, counted and named; its cached index is dropped, so the next run indexes it again.
What stays unseen without sha256: under "headers", an edit that keeps the shard's size and every
header, on a server that sends neither ETag nor Last-Modified (or a local file whose modification
time was kept); under "members", an edit of an image's middle alone (a damaged image, not
another one: two images differ at their ends) or one made to keep the CRC-32s.

Indexing ends at a stop signal (``pycls.errors.WaitStopped``, between two members, or within
seconds where it waits for a server): nothing is cached of a shard indexed in part.
"""

import contextlib
import hashlib
import json
import logging
import os
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pycls.checkpoint.files import CorruptFileError
from pycls.datasets.formats import decode, labels
from pycls.datasets.formats.image_header import DEFAULT_MAX_PIXELS, too_many_bytes, too_many_pixels
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.transport import read_deadlines, remote_files
from pycls.errors import ConfigError, WaitStopped, printable_path

logger = logging.getLogger(__name__)

# 2: the shard's end is checked (an index of version 1 may hide a shard cut short); 3: each
# sample records its image's tar header (a 64-bit digest), read again with the image; 4: that
# digest is the header's CRC-32 (a version-3 digest, 16 hex digits, is no CRC-32); 5: each
# sample also records its image's ends_digest. A cached index of any other version is made again.
INDEX_VERSION = 5
# What each process reads again with every image: the tar header block before it
_HEADER = tarfile.BLOCKSIZE
# How a shard is checked against what was indexed (DATA_LOADER.VERIFY_SHARDS)
VERIFY_MODES = ("members", "headers", "sha256")
# What of an image each read compares with the index (VERIFY_SHARDS members): the CRC-32 of its
# first and last this many bytes (all of it when it is no longer than twice this). Two different
# images differ there (a JPEG's or a PNG's compressed data begins within the first KiB and runs
# to the last bytes), at ~2 us of CPU an image: a whole image's CRC-32 cost 20-50 us (BENCHMARKS)
_ENDS = 4096
# The image members a sample may have, in the order one is picked (timm reads jpg;png;webp)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSIONS = ("cls", "json")
# Label members are read while indexing; one larger than this is not a label
_MAX_LABEL_BYTES = 1 << 16
# The most an _info.json may hold (it lists every shard's file name and length)
_MAX_INFO_BYTES = 64 << 20
# Blocks in which a URL's shard is read while indexing
_INDEX_BLOCK = 1 << 18
# A tar ends with two 512-byte blocks of zeros (POSIX), which tarfile does not check
_END_BYTES = 2 * tarfile.BLOCKSIZE
# What is read at a time of the bytes after the last member
_TAIL_BLOCK = 1 << 16
_APPENDED = "holds data after its end-of-archive blocks"


def default_cache_dir() -> Path:
    """Where tar indexes are kept without DATA_LOADER.INDEX_CACHE: tar_index/ in pycls's cache
    ($PYCLS_CACHE_DIR, else $XDG_CACHE_HOME/pycls, else ~/.cache/pycls)."""
    if os.environ.get("PYCLS_CACHE_DIR"):
        return Path(os.environ["PYCLS_CACHE_DIR"]) / "tar_index"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pycls" / "tar_index"


def _key_and_extension(name: str) -> tuple[str | None, str]:
    from webdataset.tariterators import base_plus_ext  # optional: WebDataset's own key rule

    key, ext = base_plus_ext(name)
    return key, (ext or "").lower()


def _label_of(ext: str, data: bytes) -> int | str | None:
    """The label a ``cls`` or ``json`` member stores (an integer or a class name; checked against
    the classes by ``labels.class_indices``), or None when it holds none (a JSON object without
    ``label`` or ``cls``). Raises ValueError for a value that is no label (2.5, true, text that
    is not UTF-8)."""
    if ext == "cls":
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise ValueError(f"{data[:20]!r} is not text") from None
        return labels.from_text(text)
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(value, dict):
        for field in ("label", "cls"):
            if field in value:
                return labels.from_json(value[field])
    return None


# What the index records of each image's tar header block, and each read compares: its CRC-32.
# Any change of an accidental kind shows (a deliberate one is VERIFY_SHARDS sha256's to see),
# and zlib's function itself, not a call around it, is what the reads call per image.
header_digest = zlib.crc32


def _header_words(block: bytes) -> str:
    """What a header block that differs from the indexed one says now, in words."""
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.TarError:
        return "is no tar header now"
    return f"now names {info.name!r} ({info.size:,} bytes)"


def ends_digest(image) -> int:
    """The CRC-32 of an image's first and last ``_ENDS`` bytes (of all of it, when short)."""
    if len(image) <= 2 * _ENDS:
        return zlib.crc32(image)
    return zlib.crc32(image[-_ENDS:], zlib.crc32(image[:_ENDS]))


def _member_ends(f, size: int) -> int:
    """``ends_digest`` of the member of ``size`` bytes that starts where ``f`` is."""
    if size <= 2 * _ENDS:
        data = f.read(size)
    else:
        data = f.read(_ENDS)
        f.seek(f.tell() + size - 2 * _ENDS)
        data += f.read(_ENDS)
    if len(data) != min(size, 2 * _ENDS):
        raise EOFError(f"the file ended inside a member of {size} bytes")
    return zlib.crc32(data)  # the CRC-32 of the two ends together is ends_digest's


def _members(
    url: str, size: int, retries: int, access: remote_files.Access | None = None, sha256=False
) -> tuple[list, str | None, str | None]:
    """(key, extension, data offset, data size, content for label members, (header digest,
    ends digest) for image members) of every file member of a shard, in file order (a URL read
    in one request, from start to end); what is wrong with the shard's end (None: nothing); and,
    with ``sha256``, the shard's SHA-256 (a URL's hashed as it streams by, a local file read
    again).
    tarfile stops without a word at the end of the file, at a block of zeros or at a header it
    cannot read, wherever that is: the end is checked here (``_end_problem``), so that a shard
    cut between two samples, or two tars written one after the other, is not read as a shorter
    one."""
    f = remote_files.open_file(url, retries, access, sequential=True, block_size=_INDEX_BLOCK)
    hasher = hashlib.sha256() if sha256 else None
    if hasher is not None and hasattr(f, "hasher"):  # a streamed URL: each byte once, in order
        f.hasher = hasher
    out, problem, digest = [], None, None
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                read_deadlines.check_stop(f"the index of shard {printable_path(url)}")
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    problem = (
                        f"is truncated: member {member.name!r} ends at byte "
                        f"{member.offset_data + member.size}, the file has {size}"
                    )
                    break
                key, ext = _key_and_extension(member.name)
                if key is None or os.path.basename(member.name).startswith("."):
                    continue
                content = head = None
                if ext in LABEL_EXTENSIONS and member.size <= _MAX_LABEL_BYTES:
                    content = tar.extractfile(member).read()
                if ext in IMAGE_EXTENSIONS:  # the block tarfile just read (kept behind a stream)
                    f.seek(member.offset_data - _HEADER)
                    head = (header_digest(f.read(_HEADER)), _member_ends(f, member.size))
                out.append((key, ext, member.offset_data, member.size, content, head))
            if problem is None:
                problem = _end_problem(f, tar.offset, size)
        if hasher is not None:
            digest = _sha256(f, size, hasher)
    except (tarfile.TarError, EOFError, UnicodeDecodeError) as err:
        raise CorruptFileError(
            f"shard {printable_path(url)} is not a readable tar file ({type(err).__name__}: "
            f"{' '.join(str(err).split())})"
        ) from None
    finally:
        f.close()
    return out, problem, digest


def _sha256(f, size: int, hasher) -> str:
    """The SHA-256 of the whole file ``f``: the rest of a stream that hashes as it goes, or the
    file read again from its start."""
    if getattr(f, "hasher", None) is hasher:
        f.seek(size)
    else:
        f.seek(0)
        for block in iter(lambda: f.read(1 << 20), b""):
            read_deadlines.check_stop(f"the SHA-256 of {getattr(f, 'name', 'a shard')}")
            hasher.update(block)
    return hasher.hexdigest()


def _end_problem(f, end: int, size: int) -> str | None:
    """What follows the last member (at byte ``end``) that should not: a tar ends with two
    blocks of zeros (then zeros up to its record size); fewer means the file was cut short,
    anything but zeros after them is data tarfile would never reach (a second tar appended, or
    a header it could not read). Reads from ``end`` to the first byte that is not zero: at most
    the end's padding and one block more."""
    if size - end < _END_BYTES:
        return (
            f"is truncated: it ends at byte {size} without tar's end-of-archive blocks (cut "
            "short: whatever followed the cut is missing)"
        )
    f.seek(end)
    where = end
    while where < size:
        block = f.read(min(_TAIL_BLOCK, size - where))
        if not block:
            return f"is truncated: it could not be read past byte {where} of {size}"
        zeros = len(block) - len(block.lstrip(b"\0"))
        if zeros < len(block):
            at = where + zeros
            if at < end + _END_BYTES:
                return f"has a header tar cannot read at byte {end}; what follows is never read"
            return (
                f"{_APPENDED} (at byte {at} of {size}: two tars written one after the other?); "
                "the members there would be silently left out"
            )
        where += len(block)
    return None


def _samples(url: str, members, truncated: bool = False) -> list[list]:
    """[key, image member name, offset, size, label, header digest, image digest] per sample, in
    file order (the label as stored: an integer or a class name; the CRC-32 of the header and
    the image's ``ends_digest`` as 8 hex digits each).
    ``truncated``: the shard was cut short, and its last sample (whose other members may lie
    past the cut) is left out."""
    samples, order = {}, []
    for key, ext, offset, size, content, head in members:
        if not order or key != order[-1]:
            if key in samples:
                raise CorruptFileError(
                    f"shard {printable_path(url)}: the members of sample {key!r} are not "
                    "together (WebDataset reads a sample's members one after the other)"
                )
            samples[key] = {}
            order.append(key)
        if ext in samples[key]:
            raise CorruptFileError(
                f"shard {printable_path(url)}: sample {key!r} has two {ext!r} members (written "
                "twice?); which one is meant cannot be told, so neither is taken"
            )
        samples[key][ext] = (offset, size, content, head)
    if truncated and order:
        order.pop()
    out = []
    for key in order:
        parts = samples[key]
        image = next((e for e in IMAGE_EXTENSIONS if e in parts), None)
        label = _sample_label(url, key, parts)
        if image is None or label is None:
            what = "image (jpg, jpeg, png or webp)" if image is None else "label (cls or json)"
            raise CorruptFileError(
                f"shard {printable_path(url)}: sample {key!r} has no {what}; its members: "
                f"{sorted(parts)}"
            )
        offset, size, _, (head, crc) = parts[image]
        out.append([key, f"{key}.{image}", offset, size, label, f"{head:08x}", f"{crc:08x}"])
    return out


def _sample_label(url: str, key: str, parts: dict) -> int | str | None:
    for ext in LABEL_EXTENSIONS:
        if ext not in parts or parts[ext][2] is None:
            continue
        try:
            label = _label_of(ext, parts[ext][2])
        except ValueError as err:
            raise CorruptFileError(
                f"shard {printable_path(url)}: sample {key!r} has no class index in its {ext} "
                f"member: {err}"
            ) from None
        if label is not None:
            return label
    return None


def index_shard(
    url: str, retries: int = 3, access: remote_files.Access | None = None
) -> list[list]:
    """The index of one shard: [key, image member, offset, size, label] per sample. A shard cut
    short or followed by data past its end is refused (``index_damaged`` keeps what it holds)."""
    samples, problem = index_damaged(url, retries, access)
    if problem is not None:
        raise CorruptFileError(problem)
    return samples


def index_damaged(
    url: str, retries: int = 3, access: remote_files.Access | None = None
) -> tuple[list[list], str | None]:
    """(the index of the samples a shard holds whole, what is wrong with its end or None). A
    shard that is no tar file, or whose samples are malformed, is refused (CorruptFileError)."""
    record = index_record(url, retries, access)
    return record["samples"], record["problem"]


def index_record(
    url: str, retries: int = 3, access: remote_files.Access | None = None, sha256=False
) -> dict:
    """``samples`` and ``problem`` as ``index_damaged`` returns them, and with ``sha256`` the
    shard's SHA-256 (``sha256``), read in the same pass where the shard is at a URL."""
    size = remote_files.file_size(url, retries, access)
    last = None
    for _ in range(max(1, retries)):
        try:
            members, problem, digest = _members(url, size, retries, access, sha256)
            # A tar that ends early may have lost members of its last sample
            truncated = problem is not None and not problem.startswith(_APPENDED)
            samples = _samples(url, members, truncated=truncated)
            problem = f"shard {printable_path(url)} {problem}" if problem else None
            return {"samples": samples, "problem": problem, **({"sha256": digest} if sha256
                                                                else {})}  # fmt: skip
        except (remote_files.DataPathError, remote_files.DataReadError,
                remote_files.DataChangedError, WaitStopped):  # fmt: skip
            raise  # named, and each read was tried DATA_LOADER.RETRIES times already
        except Exception as err:  # noqa: BLE001 (aiohttp, botocore ... each has its own errors)
            # A URL's connection lost mid-shard can look like a bad tar: read it again first
            if not remote_files.is_url(url):
                raise
            last = err
    if isinstance(last, CorruptFileError):
        raise last
    raise remote_files.DataReadError(
        f"cannot index shard {printable_path(url)} after {retries} attempts: {last}"
    )


class IndexCache:
    """Shard indexes in a folder, one JSON file per shard, tied to the shard's identity."""

    def __init__(self, folder: str | os.PathLike | None):
        self.folder = Path(folder) if folder else default_cache_dir()
        self._warned = False

    def _path(self, url: str) -> Path:
        digest = hashlib.sha256(url.encode()).hexdigest()[:20]
        return self.folder / f"{digest}.json"

    def get(
        self, url: str, retries: int, access: remote_files.Access | None = None, sha256=False
    ) -> dict:
        """The shard's index record: ``samples``, ``problem`` (what is wrong with the shard, or
        None; see ``index_damaged``) and, with ``sha256``, the shard's ``sha256``. A cached
        record is used while the shard's identity is the same (and, with ``sha256``, a local
        shard's SHA-256: it is read again)."""
        identity = remote_files.file_identity(url, retries, access)
        path = self._path(url)
        try:
            record = json.loads(path.read_text())
            if (
                record.get("version") == INDEX_VERSION
                and record.get("url") == url
                and (record.get("identity") == identity)
                and (not sha256 or self._same_sha256(url, record.get("sha256")))
            ):
                return record
        except (OSError, ValueError, AttributeError):
            pass
        record = index_record(url, retries, access, sha256)
        self._write(path, {"version": INDEX_VERSION, "url": url, "identity": identity, **record})
        return record

    @staticmethod
    def _same_sha256(url: str, recorded) -> bool:
        """Whether a cached SHA-256 may stand: at a URL, as the identity says (the reads compare
        it); a local shard is read and hashed."""
        if not isinstance(recorded, str):
            return False
        if remote_files.is_url(url):
            return True
        with remote_files.open_file(url) as f:
            return _sha256(f, 0, hashlib.sha256()) == recorded

    def forget(self, url: str) -> None:
        """Drops the shard's index (it changed since): the next run indexes it again."""
        with contextlib.suppress(OSError):
            self._path(url).unlink()

    def _write(self, path: Path, record: dict) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if not self._warned:
                self._warned = True
                logger.warning(
                    f"cannot keep tar indexes in {self.folder} ({err}); every run will index "
                    "the shards again (DATA_LOADER.INDEX_CACHE names another folder)"
                )


def read_info(url: str | None, retries: int = 3, access: remote_files.Access | None = None) -> dict:
    """An ``_info.json`` (timm's split record; pycls's writer adds the classes), or {}."""
    if url is None:
        return {}
    size = remote_files.file_size(url, retries, access)
    if size > _MAX_INFO_BYTES:
        raise CorruptFileError(f"{printable_path(url)} holds {size} bytes: not a dataset record")
    reader = remote_files.RangeReader(retries, access)
    reader.sizes[url], reader.whole_files = size, True
    data = reader.read(url, 0, size)
    try:
        info = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{printable_path(url)} is not JSON ({err})") from None
    return info if isinstance(info, dict) else {}


def decode_image(data, what: str, max_pixels: int) -> torch.Tensor:
    """Encoded bytes (bytes, or a view of them) to uint8 (3, H, W); a CorruptImageError naming
    ``what`` otherwise."""
    if not data:
        raise CorruptImageError(f"cannot decode image {what}: it is empty")
    if why := too_many_pixels(data, max_pixels):
        raise CorruptImageError(f"refusing image {what}: {why}")
    try:
        return decode.decode_rgb(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except ValueError as err:
        raise CorruptImageError(f"cannot decode image {what}: {err}") from err


class TarShards(Dataset):
    """Raw ``(uint8 (3, H, W), label)`` samples of WebDataset tar shards (paths or URLs), in
    the order of the shards and, within each, of the file.

    Attributes: ``labels``, ``shard_sizes`` (samples per shard, for the shard-wise orders),
    ``num_classes`` and ``classes`` (from ``info``, timm's ``_info.json``, where it records
    them; else the largest label + 1 and None), ``folder`` (``where``, for the log), ``damaged``
    (one line per shard read in part under ``skip_corrupt``), ``serves_ranges`` (False for shards
    at a URL whose server answers no byte ranges: they are read whole, streamed, and only an
    order that reads them shard by shard suits them). ``num_classes``: the bound of the labels
    where ``info`` declares no classes (the model's). ``load_many`` reads a batch's images in one
    go (concurrent ranges from a URL).

    ``access`` says how URLs are read (headers, storage options, the read-ahead bound);
    ``window``: how many consecutive samples of the file order a batch draws from (the shuffle
    buffer; ``None``: any, a random order; 0: its own, an evaluation in file order). Shards at a
    URL are read whole, and kept, when that many samples' shards fit the read-ahead bound.

    ``verify`` (DATA_LOADER.VERIFY_SHARDS): "members" reads each image with its tar header and
    compares both with the digests indexed (a URL's reads also carry its validator and its
    size); "headers" compares the header only; "sha256" also holds each shard to the SHA-256
    recorded when it was indexed (see the module).
    """

    def __init__(
        self,
        shards: list[str],
        *,
        cache_dir: str | os.PathLike | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        retries: int = 3,
        info: dict | None = None,
        where: str = "",
        access: remote_files.Access | None = None,
        window: int | None = 0,
        skip_corrupt: bool = False,
        num_classes: int | None = None,
        verify: str = "members",
    ):
        if not shards:
            raise ValueError("no tar shards to read")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.shards, self.max_pixels, self.folder = list(shards), max_pixels, where
        self._cache = cache = IndexCache(cache_dir)
        self._changed: dict[int, str] = {}  # shard -> what changed, as this process found it
        remote, sha256 = remote_files.is_url(self.shards[0]), verify == "sha256"
        threads = min(16, len(self.shards)) if remote else 1
        with ThreadPoolExecutor(threads) as pool:
            records = list(pool.map(lambda url: cache.get(url, retries, access, sha256),
                                    self.shards))  # fmt: skip
        found = [(record["samples"], record.get("problem")) for record in records]
        indexes = [samples for samples, _ in found]
        self.damaged = _damaged_shards(self.shards, found, info or {}, skip_corrupt)
        self.shard_sizes = [len(index) for index in indexes]
        rows = [row for index in indexes for row in index]
        self._shard = np.repeat(np.arange(len(indexes), dtype=np.int32), self.shard_sizes)
        self._offset = np.array([r[2] for r in rows], dtype=np.int64)
        self._size = np.array([r[3] for r in rows], dtype=np.int64)
        # Member names as fixed-width bytes: one array, not a million Python strings per worker
        self._names = np.array([r[1].encode("utf-8", "surrogateescape") for r in rows])
        self._heads = np.array([int(r[5], 16) for r in rows], dtype=np.uint32)
        # The images' own digests (their ends), compared at each read unless only headers are
        self._crcs = None if verify == "headers" else np.array([int(r[6], 16) for r in rows],
                                                                dtype=np.uint32)  # fmt: skip
        classes, declared = _declared_classes(info or {})
        limit = (declared, "the classes _info.json declares") if declared is not None else None
        if limit is None and num_classes is not None:
            limit = (num_classes, "MODEL.NUM_CLASSES")
        name_of = lambda i: f"shard {self.shard_of(i)}: sample {rows[i][0]!r}"  # noqa: E731
        indices = labels.class_indices([r[4] for r in rows], classes, limit, name_of)
        self.labels = torch.from_numpy(indices)
        self.classes = classes
        self.num_classes = declared if declared is not None else int(indices.max(initial=-1)) + 1
        self._reader = remote_files.RangeReader(retries, access)
        self.serves_ranges = True
        if remote:
            self._plan_reads(retries, access, window)
            if sha256:
                self._hold_to_digests(records)

    def _plan_reads(self, retries, access, window) -> None:
        """Whether a URL's shards are read whole (see the class), and their server's ranges;
        the sizes and validators their reads are held to (as when they were indexed)."""
        reader = self._reader
        reader.sizes = {url: remote_files.file_size(url, retries, access) for url in self.shards}
        reader.conditions = {
            url: remote_files.file_conditions(url, retries, access) for url in self.shards
        }
        self.serves_ranges = remote_files.serves_ranges(self.shards[0], access, retries)
        total, samples = sum(reader.sizes.values()), max(1, len(self))
        largest = max(reader.sizes.values())
        drawn = total if window is None else min(total, window * total // samples + 2 * largest)
        reader.whole_files = bool(window != 0) and drawn <= reader.access.readahead_bytes

    def _hold_to_digests(self, records) -> None:
        """VERIFY_SHARDS sha256 at URLs: every shard read whole and hashed, so each must fit
        what a process may keep."""
        reader, limit = self._reader, self._reader.access.readahead_bytes
        for url, record in zip(self.shards, records):
            if reader.sizes[url] > limit:
                raise ConfigError(
                    f"DATA_LOADER.VERIFY_SHARDS: 'sha256' reads each shard at a URL whole to hash "
                    f"it, and {printable_path(url)} holds {reader.sizes[url] / 2**20:,.1f} MiB, "
                    f"more than DATA_LOADER.READAHEAD_MB ({limit / 2**20:g}) lets a process "
                    "keep; raise READAHEAD_MB or verify 'headers'"
                )
            reader.digests[url] = record["sha256"]

    def shard_of(self, index: int) -> str:
        return printable_path(self.shards[int(self._shard[index])])

    def __len__(self) -> int:
        return len(self.labels)

    def _name(self, index: int) -> str:
        return self._names[index].decode("utf-8", "surrogateescape")

    def member(self, index: int) -> str:
        """The image member of sample ``index`` and its shard, as errors name them."""
        shard = self.shards[int(self._shard[index])]
        return f"{printable_path(self._name(index))} of shard {printable_path(shard)}"

    def _request(self, index: int) -> tuple[str, int, int, str]:
        """The range of the image of sample ``index`` with its tar header before it."""
        shard = self.shards[int(self._shard[index])]
        start, size = int(self._offset[index]), int(self._size[index])
        return shard, start - _HEADER, size + _HEADER, f"member {self._name(index)!r}"

    def encoded(self, index: int) -> memoryview:
        """The encoded image of sample ``index`` (a view of the bytes read)."""
        self._check_size(index)
        if self._changed:
            self._check_unchanged(index)
        try:
            raw = self._reader.read(*self._request(index))
        except remote_files.DataChangedError as err:
            raise self._shard_changed(int(self._shard[index]), err.reason, index) from None
        return self._same_header(index, raw)

    def _same_header(self, index: int, raw: bytes) -> memoryview:
        """The image's bytes of ``raw`` (its header and image as read; a view, not a copy: a
        copy of each image costs more than the reading), once the header (and, but under
        "headers", the image) is the one indexed; ShardChangedError otherwise."""
        view = memoryview(raw)
        if header_digest(view[:_HEADER]) != self._heads[index]:
            raise self._header_changed(index, view)
        if self._crcs is not None and ends_digest(view[_HEADER:]) != self._crcs[index]:
            raise self._image_changed(index)
        return view[_HEADER:]

    def _image_changed(self, index: int) -> "ShardChangedError":
        """The error of sample ``index`` whose image as read is not the one indexed (its tar
        header is): a shard replaced behind byte-identical headers."""
        reason = (f"the bytes of member {self._name(index)!r} are not the ones indexed (the "
                  "CRC-32 of its ends differs; its tar header is the same)")  # fmt: skip
        return self._shard_changed(int(self._shard[index]), reason, index)

    def _header_changed(self, index: int, view: memoryview) -> "ShardChangedError":
        """The error of sample ``index`` whose header as read (``view``'s first block) is not
        the one indexed."""
        at = int(self._offset[index]) - _HEADER
        reason = (f"the tar header of member {self._name(index)!r} (byte {at:,}) "
                  f"{_header_words(bytes(view[:_HEADER]))}")  # fmt: skip
        return self._shard_changed(int(self._shard[index]), reason, index)

    def _read_unchanged(self, indices: list[int]) -> list:
        """The ranges (header and image) of ``indices``, read in one go; where the reader finds
        a shard changed (its validator or size), that shard's samples get their errors and the
        others are read."""
        out: list = [None] * len(indices)
        pending = list(range(len(indices)))
        while pending:
            try:
                got = self._reader.read_batch([self._request(indices[i]) for i in pending])
            except remote_files.DataChangedError as err:
                if err.path not in self.shards:
                    raise
                shard = self.shards.index(err.path)
                for i in pending:
                    if int(self._shard[indices[i]]) == shard:
                        out[i] = self._shard_changed(shard, err.reason, indices[i])
                pending = [i for i in pending if out[i] is None]
                continue
            if len(pending) == len(indices):
                return got  # the common case: every range read at the first go
            for i, raw in zip(pending, got):
                out[i] = raw
            break
        return out

    def _check_unchanged(self, index: int) -> None:
        shard = int(self._shard[index])
        if shard in self._changed:
            raise ShardChangedError(
                f"refusing image {self.member(index)}: its shard changed since it was indexed "
                f"({self._changed[shard]})"
            )

    def _shard_changed(self, shard: int, reason: str, index: int) -> "ShardChangedError":
        """Records that ``shard`` changed (none of its samples is read again in this process),
        drops its cached index, and returns the error of sample ``index``."""
        if shard not in self._changed:
            self._changed[shard] = reason
            self._cache.forget(self.shards[shard])
            logger.warning(
                f"shard {printable_path(self.shards[shard])} changed since it was indexed "
                f"({reason}): none of its samples is read; its index is dropped, so the next "
                "run indexes it again"
            )
        return ShardChangedError(
            f"refusing image {self.member(index)}: its shard changed since it was indexed "
            f"({reason}; its index is dropped, so the next run indexes it again)"
        )

    def _check_size(self, index: int) -> None:
        """A member larger than any image within the pixel limit is not read at all."""
        if why := too_many_bytes(int(self._size[index]), self.max_pixels):
            raise CorruptImageError(f"refusing image {self.member(index)}: {why}")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = decode_image(self.encoded(index), self.member(index), self.max_pixels)
        return image, int(self.labels[index])

    def load_many(self, indices: list[int]) -> list:
        """The samples ``indices`` (a corrupt one as its CorruptImageError), their byte ranges
        read in one go (a URL's coalesced and fetched concurrently); a member larger than any
        image within the pixel limit is not read."""
        out = []
        for index, encoded in zip(indices, self.encoded_many(indices)):
            if isinstance(encoded, CorruptImageError):
                out.append(encoded)
                continue
            try:
                image = decode_image(encoded, self.member(index), self.max_pixels)
            except CorruptImageError as err:
                out.append(err)
            else:
                out.append((image, int(self.labels[index])))
        return out

    def encoded_many(self, indices: list[int]) -> list:
        """The encoded images of ``indices`` (``encoded`` of each, read in one go), a refused
        one as its CorruptImageError. (``_same_header`` is inlined: per sample, each call
        costs as much as the check.)"""
        data: list = [None] * len(indices)
        wanted = []
        for place, index in enumerate(indices):
            try:
                self._check_size(index)
                if self._changed:
                    self._check_unchanged(index)
                wanted.append(place)
            except CorruptImageError as err:
                data[place] = err
        picked = [indices[p] for p in wanted]
        heads, crcs, digest, ends = self._heads, self._crcs, header_digest, ends_digest
        for place, index, raw in zip(wanted, picked, self._read_unchanged(picked)):
            if isinstance(raw, Exception):
                data[place] = raw
                continue
            view = memoryview(raw)
            if digest(view[:_HEADER]) != heads[index]:
                data[place] = self._header_changed(index, view)
            elif crcs is not None and ends(view[_HEADER:]) != crcs[index]:
                data[place] = self._image_changed(index)
            else:
                data[place] = view[_HEADER:]
        return data


class ShardChangedError(CorruptImageError):
    """A sample of a shard that changed since it was indexed (its validator, size, a header, an
    image or its SHA-256 differ): refused naming the shard, or skipped under
    DATA_LOADER.SKIP_CORRUPT."""


def _declared_classes(info: dict) -> tuple[list | None, int | None]:
    """(class names, class count) as ``_info.json`` declares them (None where it does not)."""
    classes = info.get("classes")
    classes = list(classes) if isinstance(classes, list) else None
    count = info.get("num_classes")
    if classes is not None:
        return classes, len(classes)
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        return None, count
    return None, None


def recorded_lengths(info: dict) -> dict[str, int]:
    """The samples ``_info.json`` records per shard file name (timm's ``splits``: each split's
    ``filenames`` and ``shard_lengths``); a name recorded twice with two lengths is left out."""
    out: dict[str, int | None] = {}
    splits = info.get("splits")
    for split in splits.values() if isinstance(splits, dict) else []:
        if not isinstance(split, dict):
            continue
        names, lengths = split.get("filenames"), split.get("shard_lengths")
        if not isinstance(names, list) or not isinstance(lengths, list):
            continue
        for name, length in zip(names, lengths):
            if isinstance(name, str) and isinstance(length, int):
                name = name.rsplit("/", 1)[-1]
                out[name] = length if out.get(name, length) == length else None
    return {k: v for k, v in out.items() if v is not None}


def _damaged_shards(shards: list[str], found: list, info: dict, skip: bool) -> list[str]:
    """The shards whose end is damaged or whose samples differ in number from what
    ``_info.json`` records, each in one line: refused (CorruptFileError naming the first), or
    under ``skip`` returned (their whole samples are read) and logged."""
    recorded, damaged = recorded_lengths(info), []
    for url, (samples, problem) in zip(shards, found):
        want = recorded.get(str(url).rsplit("/", 1)[-1])
        count = f"holds {len(samples)} whole samples"
        if want is not None and want != len(samples):
            count += f", _info.json records {want}"
            if want > len(samples):
                count += f" ({want - len(samples)} missing)"
            problem = problem or f"shard {printable_path(url)} differs from _info.json"
        if problem:
            damaged.append(f"{problem}; it {count}")
    if damaged and not skip:
        more = f" ({len(damaged)} shards are damaged)" if len(damaged) > 1 else ""
        raise CorruptFileError(
            f"{damaged[0]}. DATA_LOADER.SKIP_CORRUPT True reads the samples it holds whole, "
            f"naming the shard{more}"
        )
    for problem in damaged:
        logger.warning(f"reading the whole samples of a damaged shard: {problem}")
    return damaged
