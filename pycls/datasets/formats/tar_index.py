"""Indexing WebDataset tar shards: where each sample's image lies in its shard, its label, and
what the shard's end and headers say, recorded once per shard and kept in a cache folder
(``IndexCache``); ``pycls.datasets.formats.tar_shards`` reads the samples by this index.

A sample is the tar members that share a key (WebDataset's rule: the member's path up to the
first dot of its file name), among them an image (``jpg``, ``jpeg``, ``png`` or ``webp``) and a
label (``cls``: the class index as text, or ``json``: an object with ``label`` or ``cls``).
Other members are ignored.

Each shard is indexed once, as wids indexes shards: the standard library's ``tarfile`` walks its
headers (through fsspec for a URL, reading the file in blocks as it goes) and the index records,
per sample, its key, where its image lies in the file and its label, the CRC-32 of the 512-byte
tar header before its image and the CRC-32 of the image's first and last 4 KiB (``ends_digest``)
that every read is compared with (and, asked for, the shard's SHA-256). Indexes are kept in a
cache folder, each tied to the shard's size and modification time (ETag for a URL), so a changed
shard is indexed again.

tarfile stops without a word at the end of the file, at a block of zeros or at a header it cannot
read, wherever it meets one; so indexing checks what follows the last member: a shard that ends
without tar's two end-of-archive blocks was cut short (inside a member or between two), and data
after them (two tars written one after the other) would never be read (``problem`` of the
record). A sample without an image or a label, with a member written twice, or whose label is no
class index (``pycls.datasets.formats.labels``) is refused naming it.

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
from pathlib import Path

from pycls.atomic_files import write_text_atomic
from pycls.checkpoint.files import CorruptFileError
from pycls.datasets.formats import labels
from pycls.datasets.transport import read_deadlines, remote_files
from pycls.errors import WaitStopped, printable_path

logger = logging.getLogger(__name__)

# 2: the shard's end is checked (an index of version 1 may hide a shard cut short); 3: each
# sample records its image's tar header (a 64-bit digest), read again with the image; 4: that
# digest is the header's CRC-32 (a version-3 digest, 16 hex digits, is no CRC-32); 5: each
# sample also records its image's ends_digest. A cached index of any other version is made again.
INDEX_VERSION = 5
# What each process reads again with every image: the tar header block before it
HEADER_BLOCK = tarfile.BLOCKSIZE
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
                    f.seek(member.offset_data - HEADER_BLOCK)
                    head = (header_digest(f.read(HEADER_BLOCK)), _member_ends(f, member.size))
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
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(record))
        except OSError as err:
            if not self._warned:
                self._warned = True
                logger.warning(
                    f"cannot keep tar indexes in {self.folder} ({err}); every run will index "
                    "the shards again (DATA_LOADER.INDEX_CACHE names another folder)"
                )
