"""Data files by local path or by URL (http(s)://, hf://, s3://, gs://, memory:// ... : whatever
protocol fsspec has installed), read as byte ranges with retries.

Local files are read with ``os.pread`` on a descriptor kept per process. A URL is read through
fsspec one byte range per sample (``cat_ranges`` fetches a batch's ranges concurrently where the
file system is asynchronous, as http and hf are): nothing is downloaded whole and nothing is
read ahead beyond the batches the loader prefetches. A range that fails (a dropped connection, a
short answer) is read again, up to ``retries`` attempts with a growing pause; then the read
fails with a ``DataReadError`` naming the URL and what was being read, never a silently missing
sample.

fsspec (and aiohttp for http) are imported when a URL is first read: a user of local files does
not need them.
"""

import glob
import os
import threading
import time
from collections.abc import Sequence

from pycls.errors import printable_path

# Seconds a URL's server may stay silent (connecting, or mid-answer) before the read is retried
READ_TIMEOUT = 60.0
# Pause before the second attempt of a failed read; it doubles each time
RETRY_PAUSE = 0.2


class DataReadError(OSError):
    """A data file (or a range of it) could not be read after every attempt; the message names
    the file, what was read and the last reason."""


def is_url(path: str) -> bool:
    """Whether ``path`` names a file through a protocol (``hf://``, ``http://`` ...) rather than
    a local path (``file://`` counts as local)."""
    return "://" in str(path) and not str(path).startswith("file://")


def local_path(path: str) -> str:
    return str(path)[len("file://") :] if str(path).startswith("file://") else str(path)


def _fsspec():
    import fsspec  # optional (pip install pycls-vit[data]): only URLs need it

    return fsspec


def _storage_options(url: str) -> dict:
    if url.startswith(("http://", "https://")):
        import aiohttp  # optional: fsspec's http file system runs on it

        timeout = aiohttp.ClientTimeout(sock_connect=READ_TIMEOUT, sock_read=READ_TIMEOUT)
        return {"client_kwargs": {"timeout": timeout}}
    return {}


# Per process (fsspec's asynchronous file systems do not survive a fork): (pid, url) -> (file
# system, path within it)
_FILESYSTEMS: dict = {}
_LOCK = threading.Lock()


def filesystem(url: str):
    """The fsspec file system of ``url`` and the path within it."""
    try:
        return _fsspec().core.url_to_fs(url, **_storage_options(url))
    except (ImportError, ValueError) as err:
        protocol = url.split("://", 1)[0]
        raise DataReadError(
            f"cannot read {printable_path(url)}: no file system for {protocol}:// ({err}); "
            "pip install fsspec (and s3fs, gcsfs or huggingface_hub for those protocols)"
        ) from None


def _fs_for(url: str):
    key = (os.getpid(), url)
    with _LOCK:
        if key not in _FILESYSTEMS:
            _FILESYSTEMS[key] = filesystem(url)
        return _FILESYSTEMS[key]


def _with_retries(read, what: str, retries: int):
    """``read()``, attempted up to ``retries`` times on an error of the transport; the last
    error is raised as a DataReadError naming ``what``."""
    pause, last = RETRY_PAUSE, None
    for attempt in range(max(1, retries)):
        if attempt:
            time.sleep(pause)
            pause *= 2
        try:
            return read()
        except FileNotFoundError:
            raise DataReadError(f"cannot read {what}: not found") from None
        except Exception as err:  # noqa: BLE001 (aiohttp, botocore ... each has its own errors)
            last = err
    reason = " ".join(f"{type(last).__name__}: {last}".split())
    raise DataReadError(f"cannot read {what} after {max(1, retries)} attempts: {reason}")


class RangeReader:
    """Reads byte ranges of files named by path or URL, with retries; per process (the
    descriptors and connections are opened again after a fork or unpickling)."""

    def __init__(self, retries: int = 3):
        self.retries = retries
        self._fds: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}}

    def _fd(self, path: str) -> int:
        key = (os.getpid(), path)
        if key not in self._fds:
            self._fds[key] = os.open(local_path(path), os.O_RDONLY)
        return self._fds[key]

    def read(self, path: str, start: int, size: int, what: str = "") -> bytes:
        """``size`` bytes of ``path`` from ``start``; ``what`` names the content in errors."""
        return self.read_many(path, [(start, size)], [what])[0]

    def read_many(
        self, path: str, ranges: Sequence[tuple[int, int]], whats: Sequence[str] = ()
    ) -> list[bytes]:
        """Several (start, size) ranges of one file, fetched concurrently from a URL."""
        whats = list(whats) or [""] * len(ranges)
        if not is_url(path):
            return [self._read_local(path, s, n, w) for (s, n), w in zip(ranges, whats)]
        fs, fs_path = _fs_for(path)
        out: list = [None] * len(ranges)
        pending = list(range(len(ranges)))
        pause = RETRY_PAUSE
        for attempt in range(max(1, self.retries)):
            if attempt:
                time.sleep(pause)
                pause *= 2
            try:
                got = fs.cat_ranges(
                    [fs_path] * len(pending),
                    [ranges[i][0] for i in pending],
                    [ranges[i][0] + ranges[i][1] for i in pending],
                    on_error="return",
                )
            except Exception as err:  # noqa: BLE001 (the whole call failed: try them all again)
                got = [err] * len(pending)
            failed = []
            for i, data in zip(pending, got):
                if isinstance(data, bytes) and len(data) == ranges[i][1]:
                    out[i] = data
                else:
                    failed.append((i, data))
            pending = [i for i, _ in failed]
            if not pending:
                return out
        i, last = failed[0]
        reason = _reason(last, ranges[i][1])
        where = f"{whats[i]} in {printable_path(path)}" if whats[i] else printable_path(path)
        raise DataReadError(
            f"cannot read {where} (bytes {ranges[i][0]}-{sum(ranges[i]) - 1}) after "
            f"{max(1, self.retries)} attempts: {reason}"
        )

    def _read_local(self, path: str, start: int, size: int, what: str) -> bytes:
        try:
            data = os.pread(self._fd(path), size, start)
        except OSError as err:
            where = f"{what} in {printable_path(path)}" if what else printable_path(path)
            raise DataReadError(f"cannot read {where}: {err}") from None
        if len(data) != size:
            where = f"{what} in {printable_path(path)}" if what else printable_path(path)
            raise DataReadError(
                f"cannot read {where}: {len(data)} of its {size} bytes are there (truncated)"
            )
        return data


def _reason(result, size: int) -> str:
    if isinstance(result, bytes):
        return f"the server answered {len(result)} bytes instead of {size}"
    return " ".join(f"{type(result).__name__}: {result}".split())


def file_size(path: str, retries: int = 3) -> int:
    """The size in bytes of a local file or a URL."""
    if not is_url(path):
        return os.path.getsize(local_path(path))
    fs, fs_path = _fs_for(path)
    return int(_with_retries(lambda: fs.size(fs_path), printable_path(path), retries))


def file_identity(path: str, retries: int = 3) -> str:
    """What changes when the file does: size and modification time (ETag for a URL that has
    one), for the caches of what was read from it."""
    if not is_url(path):
        st = os.stat(local_path(path))
        return f"{st.st_size}:{st.st_mtime_ns}"
    fs, fs_path = _fs_for(path)
    info = _with_retries(lambda: fs.info(fs_path), printable_path(path), retries)
    tag = next((info[k] for k in ("ETag", "etag", "LastModified", "mtime", "last_commit") if
                info.get(k)), "")  # fmt: skip
    return f"{info.get('size')}:{tag}"


def open_file(path: str, block_size: int = 1 << 20, retries: int = 3):
    """A seekable binary file object of a local path or a URL (the URL read in blocks of
    ``block_size`` as it is read, never whole), for libraries that read files themselves
    (tarfile, pyarrow)."""
    if not is_url(path):
        return open(local_path(path), "rb")
    fs, fs_path = _fs_for(path)
    return _with_retries(
        lambda: fs.open(fs_path, "rb", block_size=block_size, cache_type="readahead"),
        printable_path(path),
        retries,
    )


def list_files(path: str, max_depth: int = 2) -> list[str]:
    """The files in a local folder or a URL's folder and its sub-folders, ``max_depth`` levels
    in all, sorted, named as ``path`` names them (URLs keep their protocol)."""
    if not is_url(path):
        root = local_path(path)
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            depth = os.path.relpath(dirpath, root).count(os.sep) + (dirpath != root)
            if depth >= max_depth - 1:  # as fsspec's find: max_depth 1 is the folder's own files
                dirnames[:] = []
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            found += [os.path.join(dirpath, f) for f in filenames]
        return sorted(found)
    fs, fs_path = _fs_for(path)
    names = _with_retries(lambda: fs.find(fs_path, maxdepth=max_depth), printable_path(path), 3)
    if path.startswith(("http://", "https://")):
        return sorted(names)
    protocol = path.split("://", 1)[0]
    return sorted(f"{protocol}://{name}" for name in names)


def glob_files(pattern: str) -> list[str]:
    """The files a glob pattern (``*``, ``?``) matches, local or URL."""
    if not is_url(pattern):
        return sorted(glob.glob(local_path(pattern)))
    fs, fs_path = _fs_for(pattern)
    protocol = pattern.split("://", 1)[0]
    names = _with_retries(lambda: fs.glob(fs_path), printable_path(pattern), 3)
    if pattern.startswith(("http://", "https://")):
        return sorted(names)
    return sorted(f"{protocol}://{name}" for name in names)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(local_path(path))
    fs, fs_path = _fs_for(path)
    try:
        return bool(fs.isdir(fs_path))
    except Exception:  # noqa: BLE001 (a server that cannot list: not a folder we can use)
        return False
