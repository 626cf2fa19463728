"""WebDataset tar shards (timm's ``wds/`` data sets, ``timm/imagenet-1k-wds``, OpenCLIP's),
read by sample index: ``TarShards``, over the index ``pycls.datasets.formats.tar_index`` builds
once per shard (where each sample's image lies, its label, its header's and image's CRC-32s).
With the index a sample is one byte range: pycls's seeded sampler stays the one source of order,
and a resume continues at the exact next sample whatever the order.

A shard whose end is damaged (cut short, or data after its end-of-archive blocks) or whose
sample count differs from what an ``_info.json`` records is refused at the start in one line
naming it, or, under DATA_LOADER.SKIP_CORRUPT, its whole samples are read and it is named (the
log, ``skipped_files.txt``) with the samples missing. A member larger than any image within the
pixel limit is not read; an image that does not decode is a ``CorruptImageError`` naming the
shard and the member (skipped and listed under DATA_LOADER.SKIP_CORRUPT). A read that fails after
its retries is a ``DataReadError``, never a sample silently left out.

What was indexed is still what is read later in the run (DATA_LOADER.VERIFY_SHARDS): each image
is read with its header (one range) and both compared with the index (``verify="members"``, the
default; ``"headers"`` compares the header only): a shard rewritten since it was indexed is
caught wherever a header or an image read differs, so a shard replaced behind byte-identical
headers never pairs its images with the old labels. A URL's reads also carry the validator its
server gave when the shard was indexed (If-Match with its ETag, or If-Unmodified-Since: a changed
file answers 412) and must state the size indexed; a shard read whole is held to both. With
``verify="sha256"`` indexing also records each shard's SHA-256, which a shard at a URL is held to
(it is then always read whole, and hashed before any sample of it is used) and a local shard's
cached index is checked against when the split is opened. A shard found changed is a
``ShardChangedError`` (a CorruptImageError) for every sample of it this process reads
afterwards: the run stops naming it, or under DATA_LOADER.SKIP_CORRUPT its samples are skipped,
counted and named; its cached index is dropped, so the next run indexes it again. What stays
unseen without sha256: under "headers", an edit that keeps the shard's size and every header, on
a server that sends neither ETag nor Last-Modified (or a local file whose modification time was
kept); under "members", an edit of an image's middle alone (a damaged image, not another one:
two images differ at their ends) or one made to keep the CRC-32s.
"""

import json
import logging
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import Dataset

from pycls.checkpoint.files import CorruptFileError
from pycls.datasets.formats import decode, labels
from pycls.datasets.formats.image_header import DEFAULT_MAX_PIXELS, too_many_bytes, too_many_pixels
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.formats.reader_settings import VERIFY_MODES
from pycls.datasets.formats.tar_index import HEADER_BLOCK, IndexCache, ends_digest, header_digest
from pycls.datasets.transport import remote_files
from pycls.errors import ConfigError, printable_path

logger = logging.getLogger(__name__)


# The most an _info.json may hold (it lists every shard's file name and length)
_MAX_INFO_BYTES = 64 << 20


def _header_words(block: bytes) -> str:
    """What a header block that differs from the indexed one says now, in words."""
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.TarError:
        return "is no tar header now"
    return f"now names {info.name!r} ({info.size:,} bytes)"


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
        return shard, start - HEADER_BLOCK, size + HEADER_BLOCK, f"member {self._name(index)!r}"

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
        if header_digest(view[:HEADER_BLOCK]) != self._heads[index]:
            raise self._header_changed(index, view)
        if self._crcs is not None and ends_digest(view[HEADER_BLOCK:]) != self._crcs[index]:
            raise self._image_changed(index)
        return view[HEADER_BLOCK:]

    def _image_changed(self, index: int) -> "ShardChangedError":
        """The error of sample ``index`` whose image as read is not the one indexed (its tar
        header is): a shard replaced behind byte-identical headers."""
        reason = (f"the bytes of member {self._name(index)!r} are not the ones indexed (the "
                  "CRC-32 of its ends differs; its tar header is the same)")  # fmt: skip
        return self._shard_changed(int(self._shard[index]), reason, index)

    def _header_changed(self, index: int, view: memoryview) -> "ShardChangedError":
        """The error of sample ``index`` whose header as read (``view``'s first block) is not
        the one indexed."""
        at = int(self._offset[index]) - HEADER_BLOCK
        reason = (f"the tar header of member {self._name(index)!r} (byte {at:,}) "
                  f"{_header_words(bytes(view[:HEADER_BLOCK]))}")  # fmt: skip
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
            if digest(view[:HEADER_BLOCK]) != heads[index]:
                data[place] = self._header_changed(index, view)
            elif crcs is not None and ends(view[HEADER_BLOCK:]) != crcs[index]:
                data[place] = self._image_changed(index)
            else:
                data[place] = view[HEADER_BLOCK:]
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
