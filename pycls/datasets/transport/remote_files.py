"""Data files by local path or by URL (http(s)://, hf://, s3://, gs://, memory:// ... : whatever
protocol fsspec has installed), read as byte ranges or whole files, with retries.

- Local files are read with ``os.pread`` on a descriptor kept per process.
- http(s) URLs go through ``pycls.datasets.transport.http_files`` (kept-alive connections of the
  standard library; servers with and without byte ranges); other protocols through fsspec.
- ``RangeReader.read_batch`` reads a batch's samples in one go: the ranges of one file that lie
  close together are read as one larger range, and the ranges are fetched concurrently
  (``FETCHERS`` at a time per process). A reader told to read whole files (``whole_files``: the
  data a batch draws from fits ``Access.readahead_bytes``, or the server serves no ranges) reads
  each file once, whole, and keeps the last ones it read up to that many bytes.
- A read that fails in a way that may pass is tried again (``DATA_LOADER.RETRIES`` attempts, a pause
  doubling up to a minute), each failure logged with the URL, the attempt and the pause, whether it
  reads a range or a whole file (one policy: ``pycls.datasets.transport.read_attempts``); an attempt
  below its floor (``pycls.datasets.transport.read_deadlines``: DATA_LOADER.READ_TIMEOUT,
  MIN_READ_RATE_KB) fails, and a read still waiting after ``STALL_SECONDS`` is logged. A path or URL
  that does not exist, refuses access or is malformed is a ``DataPathError`` (the user's, exit
  status 2); the rest, after the last attempt, a ``DataReadError`` (the machine's, exit status 1).
  Never a sample silently left out.

What a URL needs beyond its name (``Access``: headers, storage options, the read-ahead bound), what
a file is (size, identity, ranges) and what a folder holds are
``pycls.datasets.transport.url_access``'s, re-exported here. fsspec (and aiohttp under it) is
imported when a URL of another protocol is first read: a user of local files or plain HTTP does not
need it.
"""

import hashlib
import io
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from pycls.datasets.transport import http_files
from pycls.datasets.transport.read_errors import DataChangedError, DataPathError, DataReadError
from pycls.datasets.transport.url_access import (  # noqa: F401 (the names this module has always had)
    DEFAULT_READAHEAD,
    MAX_RETRY_PAUSE,
    READ_TIMEOUT,
    RETRY_PAUSE,
    Access,
    access_from,
    attempt,
    expand_variables,
    file_conditions,
    file_identity,
    file_size,
    filesystem,
    fs_for,
    glob_files,
    is_http,
    is_url,
    isdir,
    list_files,
    local_path,
    open_local,
    serves_ranges,
    session,
    too_large_without_ranges,
)
from pycls.errors import printable_path

__all__ = ["Access", "DataChangedError", "DataPathError", "DataReadError", "RangeReader", "is_url"]

logger = logging.getLogger(__name__)

# Seconds a read may wait before the log says so (it goes on while above its floor rate)
STALL_SECONDS = 10.0
# Reads in flight at once per process (threads of kept-alive connections)
FETCHERS = 8
# Ranges of one file this close together are read as one (a request costs more than a few
# hundred KB of a fast link), up to this long
MERGE_GAP = 256 << 10
MAX_SPAN = 8 << 20
# One pool of fetching threads per process
_POOLS: dict = {}
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        pool = _POOLS.get(os.getpid())
        if pool is None:
            pool = _POOLS[os.getpid()] = ThreadPoolExecutor(FETCHERS, "pycls-fetch")
        return pool


# ------------------------------------------------------------------------------------------------ #
# Files read whole, kept within a bound
# ------------------------------------------------------------------------------------------------ #


class WholeFiles:
    """The files a process read whole, the least recently used dropped beyond ``limit`` bytes."""

    def __init__(self, limit: int):
        self.limit, self.held, self._files = limit, 0, OrderedDict()
        self._lock = threading.Lock()

    def get(self, url: str) -> bytes | None:
        with self._lock:
            data = self._files.get(url)
            if data is not None:
                self._files.move_to_end(url)
            return data

    def make_room(self, size: int) -> None:
        with self._lock:
            while self._files and self.held + size > self.limit:
                self.held -= len(self._files.popitem(last=False)[1])

    def put(self, url: str, data: bytes) -> None:
        if len(data) > self.limit:
            return
        self.make_room(len(data))
        with self._lock:
            if url not in self._files:
                self._files[url] = data
                self.held += len(data)


# ------------------------------------------------------------------------------------------------ #
# Reading ranges: local, by URL, coalesced, concurrent
# ------------------------------------------------------------------------------------------------ #


def coalesce(ranges: Sequence[tuple[int, int]], gap: int = MERGE_GAP, longest: int = MAX_SPAN):
    """Spans ``(start, size, [indices of ranges])`` covering ``ranges`` ((start, size) each):
    ranges at most ``gap`` bytes apart share a span, as long as it stays within ``longest``."""
    spans = []
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
        start, size = ranges[i]
        if spans:
            first, length, members = spans[-1]
            end = max(first + length, start + size)
            if start - (first + length) <= gap and end - first <= longest:
                spans[-1] = (first, end - first, members + [i])
                continue
        spans.append((start, size, [i]))
    return spans


def _where(path: str, what: str) -> str:
    return f"{what} in {printable_path(path)}" if what else printable_path(path)


class RangeReader:
    """Reads byte ranges of files named by path or URL, with retries; per process (the
    descriptors, connections and kept files are opened again after a fork or unpickling).

    ``whole_files``: URLs are read whole (and kept within ``access.readahead_bytes``) rather
    than by ranges; a server without ranges is read so whatever it says. ``sizes`` may give the
    files' sizes (else asked for).

    What was indexed is what is read (a ``DataChangedError`` otherwise, never retried): a URL's
    requests carry ``conditions[url]`` (its validator when indexed, ``file_conditions``),
    every answer must state the file's size in ``sizes``, and a URL with a SHA-256 in
    ``digests`` is always read whole, its bytes hashed and compared before any range of them is
    returned."""

    def __init__(self, retries: int = 3, access: Access | None = None):
        self.retries, self.access = retries, access or Access()
        self.whole_files = False
        self.sizes: dict[str, int] = {}
        self.conditions: dict[str, dict] = {}
        self.digests: dict[str, str] = {}
        self._fds: dict = {}
        self._kept: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}, "_kept": {}}

    def _fd(self, path: str) -> int:
        key = (os.getpid(), path)
        if key not in self._fds:
            self._fds[key] = open_local(path)
        return self._fds[key]

    def kept(self) -> WholeFiles:
        pid = os.getpid()
        if pid not in self._kept:
            self._kept = {pid: WholeFiles(self.access.readahead_bytes)}
        return self._kept[pid]

    def whole(self, path: str) -> bytes:
        """The whole file at URL ``path``, kept (within the bound) for the next call."""
        data = self.kept().get(path)
        if data is None:
            job = _WholeJob(self, path, [], [], [])
            self._run([job])
            data = job.data
        return data

    def read(self, path: str, start: int, size: int, what: str = "") -> bytes:
        """``size`` bytes of ``path`` from ``start``; ``what`` names the content in errors."""
        return self.read_batch([(path, start, size, what)])[0]

    def read_many(
        self, path: str, ranges: Sequence[tuple[int, int]], whats: Sequence[str] = ()
    ) -> list[bytes]:
        """Several (start, size) ranges of one file."""
        whats = list(whats) or [""] * len(ranges)
        return self.read_batch([(path, s, n, w) for (s, n), w in zip(ranges, whats)])

    def read_batch(self, requests: Sequence[tuple[str, int, int, str]]) -> list[bytes]:
        """The bytes of each ``(path, start, size, what)``: local ones read in turn; a URL's
        ranges coalesced and fetched concurrently (or its file read whole, see the class)."""
        out: list = [None] * len(requests)
        by_path: dict[str, list[int]] = {}
        for i, (path, _, _, _) in enumerate(requests):
            by_path.setdefault(path, []).append(i)
        jobs = []
        for path, picked in by_path.items():
            if not is_url(path):
                for i in picked:
                    _, start, size, what = requests[i]
                    out[i] = self._read_local(path, start, size, what)
            elif self._whole(path):
                jobs += self._whole_jobs(path, picked, requests, out)
            else:
                jobs += self._span_jobs(path, picked, requests, out)
        self._run(jobs)
        return out

    # -- planning --------------------------------------------------------------------------- #
    def _whole(self, path: str) -> bool:
        if path in self.digests or (is_http(path) and not serves_ranges(path, self.access,
                                                                        ask=False)):  # fmt: skip
            return True
        return self.whole_files and self.size(path) * 2 <= self.access.readahead_bytes

    def size(self, path: str) -> int:
        if path not in self.sizes:
            self.sizes[path] = file_size(path, self.retries, self.access)
        return self.sizes[path]

    def _span_jobs(self, path, picked, requests, out):
        ranges = [(requests[i][1], requests[i][2]) for i in picked]
        longest = max(1 << 20, min(MAX_SPAN, self.access.readahead_bytes // FETCHERS))
        jobs = []
        for start, size, members in coalesce(ranges, longest=longest):
            targets = [picked[m] for m in members]
            what = requests[targets[0]][3]
            if len(targets) > 1:
                what = f"{what or 'a range'} and {len(targets) - 1} more"
            jobs.append(_SpanJob(self, path, start, size, targets, requests, out, what))
        return jobs

    def _whole_jobs(self, path, picked, requests, out):
        data = self.kept().get(path)
        if data is not None:
            for i in picked:
                _, start, size, what = requests[i]
                out[i] = _cut(data, start, size, path, what)
            return []
        return [_WholeJob(self, path, picked, requests, out)]

    def _run(self, jobs) -> None:
        """Runs ``jobs`` concurrently, the files read whole in waves whose sizes fit the bound
        together; logs a read that keeps waiting; raises the first failure."""
        waves, wave, held = [], [], 0
        for job in jobs:
            size = job.holds()
            if wave and held + size > self.access.readahead_bytes:
                waves.append(wave)
                wave, held = [], 0
            wave.append(job)
            held += size
        waves.append(wave)
        for wave in waves:
            if wave:
                self.kept().make_room(sum(job.holds() for job in wave))
                _run_together(wave)

    def _read_local(self, path: str, start: int, size: int, what: str) -> bytes:
        try:
            data = os.pread(self._fd(path), size, start)
        except OSError as err:
            raise DataReadError(f"cannot read {_where(path, what)}: {err}") from None
        if len(data) != size:
            raise DataReadError(
                f"cannot read {_where(path, what)}: {len(data)} of its {size} bytes are there "
                "(truncated)"
            )
        return data


def _cut(data: bytes, start: int, size: int, path: str, what: str) -> bytes:
    piece = data[start : start + size]
    if len(piece) != size:
        raise DataReadError(
            f"cannot read {_where(path, what)}: {len(piece)} of its {size} bytes are in the "
            f"file (it has {len(data)}; changed since it was indexed?)"
        )
    return piece


def _run_together(jobs) -> None:
    futures = {_pool().submit(job): job for job in jobs}
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=STALL_SECONDS, return_when=FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                for other in pending:
                    other.cancel()
                raise future.exception()
        now = time.monotonic()
        for future in pending:
            job = futures[future]
            since = job.state.get("since")
            if (
                since is not None
                and now - since >= STALL_SECONDS
                and job.state.get("attempt") != job.state.get("reported")
            ):
                job.state["reported"] = job.state["attempt"]
                access = job.reader.access
                logger.warning(
                    f"reading {job.describe()} has waited {now - since:.3g} s on attempt "
                    f"{job.state['attempt']} of {max(1, job.reader.retries)} (an attempt is "
                    f"given up when less than {access.min_rate / 1024:g} KiB/s arrive over "
                    f"{access.read_timeout:g} s)"
                )


class _SpanJob:
    """One coalesced range of a URL, cut into the ranges it covers."""

    def __init__(self, reader, path, start, size, targets, requests, out, what):
        self.reader, self.path, self.start, self.size = reader, path, start, size
        self.targets, self.requests, self.out, self.what = targets, requests, out, what
        self.state: dict = {}

    def holds(self) -> int:
        return 0  # a span is at most MAX_SPAN: not counted against the bound

    def describe(self) -> str:
        return f"{_where(self.path, self.what)} (bytes {self.start}-{self.start + self.size - 1})"

    def __call__(self) -> None:
        data = attempt(self._fetch, self.describe(), self.path, self.reader.retries, self.state)
        for i in self.targets:
            _, start, size, _ = self.requests[i]
            self.out[i] = data[start - self.start : start - self.start + size]

    def _fetch(self) -> bytes:
        if is_http(self.path):
            reader = self.reader
            data = session(reader.access).read_range(
                self.path, self.start, self.size, reader.conditions.get(self.path),
                reader.sizes.get(self.path))  # fmt: skip
        else:
            fs, fs_path = fs_for(self.path, self.reader.access)
            data = fs.cat_file(fs_path, start=self.start, end=self.start + self.size)
        if len(data) != self.size:
            raise http_files.ShortAnswer(
                f"the server answered {len(data)} bytes instead of {self.size}"
            )
        return data


class _WholeJob:
    """A URL's file read whole (kept when it fits the bound), or, larger, streamed from its start
    to the last range needed, keeping only those."""

    def __init__(self, reader, path, picked, requests, out):
        self.reader, self.path, self.picked, self.requests, self.out = (
            reader, path, picked, requests, out)  # fmt: skip
        self.state: dict = {}
        self.data = None

    def keeps(self) -> bool:
        return self.reader.size(self.path) <= self.reader.access.readahead_bytes

    def holds(self) -> int:
        return self.reader.size(self.path) if self.keeps() else 0

    def describe(self) -> str:
        return f"{printable_path(self.path)} (the whole file)"

    def __call__(self) -> None:
        reader = self.reader
        if self.keeps():
            if is_http(self.path):  # each request tried by the policy, resumed where it broke
                data = self._stream()
            else:
                data = attempt(self._fetch, self.describe(), self.path, reader.retries, self.state)
            self._check_digest(data)
            reader.kept().put(self.path, data)
            self.data = data
            for i in self.picked:
                _, start, size, what = self.requests[i]
                self.out[i] = _cut(data, start, size, self.path, what)
            return
        with open_file(self.path, reader.retries, reader.access, sequential=True,
                       size=reader.size(self.path),
                       conditions=reader.conditions.get(self.path)) as f:  # fmt: skip
            for i in sorted(self.picked, key=lambda i: self.requests[i][1]):
                _, start, size, what = self.requests[i]
                f.seek(start)
                self.out[i] = _cut(f.read(size), 0, size, self.path, what)

    def _stream(self) -> bytes:
        """The whole file of an http(s) URL, streamed: each request an attempt of the reader's
        policy (a 5xx, a dropped connection or a stall is tried again, from where it broke)."""
        reader, size = self.reader, self.reader.size(self.path)
        stream = http_files.StreamedFile(session(reader.access), self.path, reader.retries, size,
                                         reader.conditions.get(self.path), self.state)  # fmt: skip
        with stream:
            data = stream.read()
        if len(data) != size:
            raise DataReadError(
                f"cannot read {self.describe()}: the server sent {len(data):,} bytes of its "
                f"{size:,}, asked again from where it stopped"
            )
        return data

    def _fetch(self) -> bytes:
        reader, size = self.reader, self.reader.size(self.path)
        fs, fs_path = fs_for(self.path, reader.access)
        data = fs.cat_file(fs_path)
        if len(data) != size:  # the whole object, as it is now
            raise DataChangedError(
                self.path, f"it holds {len(data):,} bytes, {size:,} when it was indexed"
            )
        return data

    def _check_digest(self, data: bytes) -> None:
        digest = self.reader.digests.get(self.path)
        if digest is not None and hashlib.sha256(data).hexdigest() != digest:
            raise DataChangedError(
                self.path, f"its SHA-256 is no longer {digest[:16]}... (DATA_LOADER.VERIFY_SHARDS)"
            )
        return data


class _RangedFile(io.RawIOBase):
    """A URL's file read at any place by byte ranges (pyarrow reading parquet's footer and row
    groups), each read one request."""

    def __init__(self, reader: RangeReader, url: str):
        super().__init__()
        self.reader, self.url, self.size, self._pos = reader, url, reader.size(url), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self._pos + size)
        if end <= self._pos:
            return b""
        data = self.reader.read(self.url, self._pos, end - self._pos)
        self._pos = end
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def open_file(path: str, retries: int = 3, access: Access | None = None, *,
              sequential: bool = False, block_size: int = 1 << 20, size: int | None = None,
              conditions: dict | None = None):  # fmt: skip
    """A seekable binary file object of a local path or a URL, for libraries that read files
    themselves. ``sequential`` (tarfile indexing a shard): read from start to end in one request.
    Otherwise (pyarrow) read where asked, by byte ranges; from a server without ranges the file is
    read whole, if it fits ``access.readahead_bytes``, else a DataPathError says so. An http(s)
    URL's requests carry ``conditions`` and every answer must state ``size`` (as indexed;
    default: what this process was told first), else DataChangedError."""
    access = access or Access()
    if not is_url(path):
        return os.fdopen(open_local(path), "rb")
    if is_http(path):
        size = file_size(path, retries, access) if size is None else size
        if sequential:
            return http_files.StreamedFile(session(access), path, retries, size, conditions)
        reader = RangeReader(retries, access)
        reader.sizes[path] = size
        reader.conditions[path] = dict(conditions or {})
        if serves_ranges(path, access, retries):
            return io.BufferedReader(_RangedFile(reader, path), block_size)
        if size > access.readahead_bytes:
            raise too_large_without_ranges(path, size, access.readahead_bytes)
        reader.whole_files = True
        return io.BytesIO(reader.read(path, 0, size))
    fs, fs_path = fs_for(path, access)
    cache = "readahead" if sequential else "bytes"
    return attempt(lambda: fs.open(fs_path, "rb", block_size=block_size, cache_type=cache),
                    printable_path(path), path, retries)  # fmt: skip
