"""WebDataset tar shards (timm's ``wds/`` data sets, ``timm/imagenet-1k-wds``, OpenCLIP's),
read by sample index: ``TarShards``.

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

A shard that is not a tar file, or that ends inside a member, is refused at the start in one line
naming it; so is a sample without an image or a label. An image that does not decode is a
``CorruptImageError`` naming the shard and the member (skipped and listed under
DATA_LOADER.SKIP_CORRUPT). A read that fails after its retries is a ``DataReadError``, never a
sample silently left out.
"""

import hashlib
import json
import logging
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pycls.checkpoint.files import CorruptFileError
from pycls.datasets import decode, remote_files
from pycls.datasets.image_header import DEFAULT_MAX_PIXELS, too_many_pixels
from pycls.datasets.imagefolder import CorruptImageError
from pycls.errors import printable_path

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
# The image members a sample may have, in the order one is picked (timm reads jpg;png;webp)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSIONS = ("cls", "json")
# Label members are read while indexing; one larger than this is not a label
_MAX_LABEL_BYTES = 1 << 16
# The most an _info.json may hold (it lists every shard's file name and length)
_MAX_INFO_BYTES = 64 << 20
# Blocks in which a URL's shard is read while indexing
_INDEX_BLOCK = 1 << 18


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


def _label_of(ext: str, data: bytes) -> int | None:
    try:
        if ext == "cls":
            return int(data.decode().strip())
        value = json.loads(data)
        if isinstance(value, dict):
            for field in ("label", "cls"):
                if isinstance(value.get(field), int) and not isinstance(value[field], bool):
                    return value[field]
    except (ValueError, UnicodeDecodeError):
        return None
    return None


def _members(
    url: str, size: int, retries: int, access: remote_files.Access | None = None
) -> list[tuple[str, str, int, int, bytes | None]]:
    """(key, extension, data offset, data size, content for label members) of every file member
    of a shard, in file order (a URL read in one request, from start to end)."""
    f = remote_files.open_file(url, retries, access, sequential=True, block_size=_INDEX_BLOCK)
    out = []
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    raise CorruptFileError(
                        f"shard {printable_path(url)} is truncated: member {member.name!r} ends "
                        f"at byte {member.offset_data + member.size}, the file has {size}"
                    )
                key, ext = _key_and_extension(member.name)
                if key is None or os.path.basename(member.name).startswith("."):
                    continue
                content = None
                if ext in LABEL_EXTENSIONS and member.size <= _MAX_LABEL_BYTES:
                    content = tar.extractfile(member).read()
                out.append((key, ext, member.offset_data, member.size, content))
    except (tarfile.TarError, EOFError, UnicodeDecodeError) as err:
        raise CorruptFileError(
            f"shard {printable_path(url)} is not a readable tar file ({type(err).__name__}: "
            f"{' '.join(str(err).split())})"
        ) from None
    finally:
        f.close()
    return out


def _samples(url: str, members) -> list[list]:
    """[key, image member name, offset, size, label] per sample, in file order."""
    samples, order = {}, []
    for key, ext, offset, size, content in members:
        if not order or key != order[-1]:
            if key in samples:
                raise CorruptFileError(
                    f"shard {printable_path(url)}: the members of sample {key!r} are not "
                    "together (WebDataset reads a sample's members one after the other)"
                )
            samples[key] = {}
            order.append(key)
        samples[key][ext] = (offset, size, content)
    out = []
    for key in order:
        parts = samples[key]
        image = next((e for e in IMAGE_EXTENSIONS if e in parts), None)
        label = next(
            (lab for e in LABEL_EXTENSIONS if e in parts
             for lab in [_label_of(e, parts[e][2] or b"")] if lab is not None),
            None,
        )  # fmt: skip
        if image is None or label is None:
            what = "image (jpg, jpeg, png or webp)" if image is None else "label (cls or json)"
            raise CorruptFileError(
                f"shard {printable_path(url)}: sample {key!r} has no {what}; its members: "
                f"{sorted(parts)}"
            )
        offset, size, _ = parts[image]
        out.append([key, f"{key}.{image}", offset, size, label])
        if label < 0:
            raise CorruptFileError(f"shard {printable_path(url)}: sample {key!r} has label {label}")
    return out


def index_shard(
    url: str, retries: int = 3, access: remote_files.Access | None = None
) -> list[list]:
    """The index of one shard: [key, image member, offset, size, label] per sample."""
    size = remote_files.file_size(url, retries, access)
    last = None
    for _ in range(max(1, retries)):
        try:
            return _samples(url, _members(url, size, retries, access))
        except remote_files.DataPathError:
            raise
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

    def get(self, url: str, retries: int, access: remote_files.Access | None = None) -> list[list]:
        identity = remote_files.file_identity(url, retries, access)
        path = self._path(url)
        try:
            record = json.loads(path.read_text())
            if (
                record.get("version") == INDEX_VERSION
                and record.get("url") == url
                and (record.get("identity") == identity)
            ):
                return record["samples"]
        except (OSError, ValueError, AttributeError):
            pass
        samples = index_shard(url, retries, access)
        record = {"version": INDEX_VERSION, "url": url, "identity": identity, "samples": samples}
        self._write(path, record)
        return samples

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


def decode_image(data: bytes, what: str, max_pixels: int) -> torch.Tensor:
    """Encoded bytes to uint8 (3, H, W); a CorruptImageError naming ``what`` otherwise."""
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
    them; else the largest label + 1 and None), ``folder`` (``where``, for the log),
    ``serves_ranges`` (False for shards at a URL whose server answers no byte ranges: they are
    read whole, streamed, and only an order that reads them shard by shard suits them).
    ``load_many`` reads a batch's images in one go (concurrent ranges from a URL).

    ``access`` says how URLs are read (headers, storage options, the read-ahead bound);
    ``window``: how many consecutive samples of the file order a batch draws from (the shuffle
    buffer; ``None``: any, a random order; 0: its own, an evaluation in file order). Shards at a
    URL are read whole, and kept, when that many samples' shards fit the read-ahead bound.
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
    ):
        if not shards:
            raise ValueError("no tar shards to read")
        self.shards, self.max_pixels, self.folder = list(shards), max_pixels, where
        cache = IndexCache(cache_dir)
        remote = remote_files.is_url(self.shards[0])
        threads = min(16, len(self.shards)) if remote else 1
        with ThreadPoolExecutor(threads) as pool:
            indexes = list(pool.map(lambda url: cache.get(url, retries, access), self.shards))
        self.shard_sizes = [len(index) for index in indexes]
        rows = [row for index in indexes for row in index]
        self._shard = np.repeat(np.arange(len(indexes), dtype=np.int32), self.shard_sizes)
        self._offset = np.array([r[2] for r in rows], dtype=np.int64)
        self._size = np.array([r[3] for r in rows], dtype=np.int64)
        # Member names as fixed-width bytes: one array, not a million Python strings per worker
        self._names = np.array([r[1].encode("utf-8", "surrogateescape") for r in rows])
        self.labels = torch.tensor([r[4] for r in rows], dtype=torch.int64)
        self.classes, self.num_classes = _classes(info or {}, self.labels)
        self._reader = remote_files.RangeReader(retries, access)
        self.serves_ranges = True
        if remote:
            self._plan_reads(retries, access, window)

    def _plan_reads(self, retries, access, window) -> None:
        """Whether a URL's shards are read whole (see the class), and their server's ranges."""
        reader = self._reader
        reader.sizes = {url: remote_files.file_size(url, retries, access) for url in self.shards}
        self.serves_ranges = remote_files.serves_ranges(self.shards[0], access, retries)
        total, samples = sum(reader.sizes.values()), max(1, len(self))
        largest = max(reader.sizes.values())
        drawn = total if window is None else min(total, window * total // samples + 2 * largest)
        reader.whole_files = bool(window != 0) and drawn <= reader.access.readahead_bytes

    def __len__(self) -> int:
        return len(self.labels)

    def _name(self, index: int) -> str:
        return self._names[index].decode("utf-8", "surrogateescape")

    def member(self, index: int) -> str:
        """The image member of sample ``index`` and its shard, as errors name them."""
        shard = self.shards[int(self._shard[index])]
        return f"{printable_path(self._name(index))} of shard {printable_path(shard)}"

    def _request(self, index: int) -> tuple[str, int, int, str]:
        shard = self.shards[int(self._shard[index])]
        start, size = int(self._offset[index]), int(self._size[index])
        return shard, start, size, f"member {self._name(index)!r}"

    def encoded(self, index: int) -> bytes:
        return self._reader.read(*self._request(index))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = decode_image(self.encoded(index), self.member(index), self.max_pixels)
        return image, int(self.labels[index])

    def load_many(self, indices: list[int]) -> list:
        """The samples ``indices`` (a corrupt one as its CorruptImageError), their byte ranges
        read in one go (a URL's coalesced and fetched concurrently)."""
        data = self._reader.read_batch([self._request(i) for i in indices])
        out = []
        for index, encoded in zip(indices, data):
            try:
                image = decode_image(encoded, self.member(index), self.max_pixels)
            except CorruptImageError as err:
                out.append(err)
            else:
                out.append((image, int(self.labels[index])))
        return out


def _classes(info: dict, labels: torch.Tensor) -> tuple[list | None, int]:
    classes = info.get("classes")
    classes = list(classes) if isinstance(classes, list) else None
    recorded = info.get("num_classes")
    if classes is not None:
        recorded = len(classes)
    largest = int(labels.max()) + 1 if len(labels) else 0
    if isinstance(recorded, int) and recorded >= largest:
        return classes, recorded
    return None, largest
