"""What reading a path or URL needs besides the bytes: how a URL is reached (``Access``: the
request headers of a private server, fsspec's storage options, the read-ahead bound, the
attempts), this process's HTTP session and fsspec file systems, and what a file is (its size,
identity, whether its server serves byte ranges) or a folder holds (its listing, a glob).

Every failure is one of pycls.datasets.transport.read_errors: ``DataPathError`` (the path or URL is
the user's to fix) or ``DataReadError`` (the machine failed, after the attempts). Byte ranges and
file objects are read by ``pycls.datasets.transport.remote_files``, which also re-exports these
names.
"""

import fnmatch
import glob
import json
import os
import re
import threading
from dataclasses import dataclass, field

from pycls.datasets.transport import http_files
from pycls.datasets.transport.read_errors import DataPathError, DataReadError, hide
from pycls.errors import printable_path

# An attempt's window (seconds) and floor (bytes a second): pycls.datasets.transport.read_deadlines
READ_TIMEOUT = http_files.READ_TIMEOUT
MIN_READ_RATE = http_files.MIN_READ_RATE
# Pause before the second attempt of a failed read; it doubles each time, up to MAX_RETRY_PAUSE
RETRY_PAUSE = http_files.RETRY_PAUSE
MAX_RETRY_PAUSE = http_files.MAX_RETRY_PAUSE
DEFAULT_READAHEAD = 256 << 20


# ------------------------------------------------------------------------------------------------ #
# What a URL needs: headers, storage options, the read-ahead bound
# ------------------------------------------------------------------------------------------------ #

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# What an HTTP header's name may hold (RFC 9110's token), and the characters no value may hold:
# control characters but the tab (a CR or LF would end the header, or start another)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NOT_IN_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def expand_variables(value, where: str):
    """``value`` (a JSON value) with every ``${VAR}`` in its strings replaced by the environment
    variable VAR; a DataPathError naming ``where`` and VAR when it is not set. Every value read
    is hidden from messages from now on (``read_errors.hide``)."""
    if isinstance(value, dict):
        return {k: expand_variables(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_variables(v, where) for v in value]
    if not isinstance(value, str):
        return value

    def lookup(match):
        name = match.group(1)
        if name not in os.environ:
            raise DataPathError(f"{where}: the environment variable {name} is not set")
        hide(os.environ[name], name)
        return os.environ[name]

    return _VARIABLE.sub(lookup, value)


def _value_problem(text: str) -> str | None:
    """What keeps ``text`` from being an HTTP header's value, in words (never the text)."""
    bad = _NOT_IN_VALUE.search(text)
    if bad is not None:
        names = {"\r": "a carriage return (CR)", "\n": "a line feed (LF)", "\0": "a NUL byte"}
        what = names.get(bad.group(), f"the control character U+{ord(bad.group()):04X}")
        where = "at its end" if bad.start() == len(text) - 1 else f"at character {bad.start() + 1}"
        return f"holds {what} {where}"
    try:
        text.encode("latin-1")
    except UnicodeEncodeError as err:
        return (f"holds a character HTTP headers cannot carry (U+{ord(text[err.start]):04X}, "
                f"at character {err.start + 1}; headers are Latin-1)")  # fmt: skip
    return None


def check_headers(headers, where: str) -> None:
    """Every header as written (``headers``: name -> value with ``${VAR}``) must be one HTTP can
    carry once its variables are expanded: a DataPathError naming ``where``, the header and the
    variable that holds the bad character (a CRLF .env file leaves a CR at the end of each
    value), never a value. Checked once, where the variables are read, not at each request."""
    for name, template in (headers or {}).items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise DataPathError(f"{where}: {name!r} is not an HTTP header name")
        if not isinstance(template, str):
            raise DataPathError(f"{where}: the value of header {name} is not text")
        for match in _VARIABLE.finditer(template):
            problem = _value_problem(os.environ.get(match.group(1), ""))
            if problem:
                raise DataPathError(
                    f"{where}: header {name}: the environment variable {match.group(1)} "
                    f"{problem}, which no HTTP header may carry (its value is not shown; a .env "
                    "file with Windows line ends leaves a CR at the end of each value)"
                )
        problem = _value_problem(_VARIABLE.sub("", template))
        if problem:
            raise DataPathError(f"{where}: the value of header {name} as written {problem}")


@dataclass(frozen=True, repr=False)
class Access:
    """How URLs are read. ``storage_options``: fsspec's options for protocols other than
    http(s) (``{"token": ...}``, ``{"anon": true}``), whose ``headers`` entry is also what
    http(s) requests carry; ``readahead_bytes``: what each process may keep of files read whole.
    Its repr shows no value: a token stays out of logs and messages."""

    storage_options: dict = field(default_factory=dict)
    readahead_bytes: int = DEFAULT_READAHEAD
    retries: int = 3
    read_timeout: float = READ_TIMEOUT
    min_rate: float = MIN_READ_RATE

    def __repr__(self) -> str:
        return f"Access(options {sorted(self.storage_options)}, readahead {self.readahead_bytes})"

    @property
    def headers(self) -> dict:
        return dict(self.storage_options.get("headers") or {})

    def key(self) -> str:
        limits = (self.read_timeout, self.min_rate)
        return json.dumps([self.storage_options, limits], sort_keys=True, default=str)


def access_from(
    storage_options: str = "",
    readahead_mb: int = DEFAULT_READAHEAD >> 20,
    retries: int = 3,
    where: str = "DATA_LOADER.STORAGE_OPTIONS",
    read_timeout: float = READ_TIMEOUT,
    min_rate_kb: float = MIN_READ_RATE / 1024,
) -> Access:
    """The Access of the config's text (a JSON object, ``${VAR}`` taken from the environment;
    its headers checked once they are: ``check_headers``), the read-ahead bound, the attempts and
    each attempt's window (s) and floor (KiB/s)."""
    options = json.loads(storage_options) if storage_options.strip() else {}
    if isinstance(options, dict) and isinstance(options.get("headers"), dict):
        check_headers(options["headers"], where)
    return Access(expand_variables(options, where), int(readahead_mb) << 20, int(retries),
                  float(read_timeout), float(min_rate_kb) * 1024)  # fmt: skip


_PLAIN = Access()


def is_url(path: str) -> bool:
    """Whether ``path`` names a file through a protocol (``hf://``, ``http://`` ...) rather than
    a local path (``file://`` counts as local)."""
    return "://" in str(path) and not str(path).startswith("file://")


def is_http(path: str) -> bool:
    return str(path).startswith(("http://", "https://"))


def local_path(path: str) -> str:
    return str(path)[len("file://") :] if str(path).startswith("file://") else str(path)


# ------------------------------------------------------------------------------------------------ #
# Per process: the HTTP session, fsspec's file systems
# ------------------------------------------------------------------------------------------------ #

# (pid, access key) -> Session / (pid, url-or-protocol, access key) -> (fs, path); asynchronous
# file systems and sockets do not survive a fork
_SESSIONS: dict = {}
_FILESYSTEMS: dict = {}
_LOCK = threading.Lock()


def session(access: Access | None = None) -> http_files.Session:
    """This process's HTTP session for ``access``; a forked loader worker's starts knowing the
    servers its parent found to serve no ranges (said once, by the parent)."""
    access = access or _PLAIN
    key = (os.getpid(), access.key())
    with _LOCK:
        if key not in _SESSIONS:
            _SESSIONS[key] = http_files.Session(access.headers, access.read_timeout,
                                                access.min_rate)  # fmt: skip
            for (_, other), parent in list(_SESSIONS.items()):
                if other == key[1]:
                    _SESSIONS[key].no_ranges |= parent.no_ranges
        return _SESSIONS[key]


def _fsspec():
    import fsspec  # optional (pip install pycls-vit[data]): only URLs of other protocols need it

    return fsspec


def filesystem(url: str, access: Access | None = None):
    """The fsspec file system of ``url`` and the path within it (a protocol other than http)."""
    options = {k: v for k, v in (access or _PLAIN).storage_options.items() if k != "headers"}
    try:
        return _fsspec().core.url_to_fs(url, **options)
    except (ImportError, ValueError) as err:
        protocol = url.split("://", 1)[0]
        raise DataPathError(
            f"cannot read {printable_path(url)}: no file system for {protocol}:// ("
            f"{' '.join(str(err).split())}); pip install fsspec (and s3fs, gcsfs or "
            "huggingface_hub for those protocols)"
        ) from None


def fs_for(url: str, access: Access | None):
    key = (os.getpid(), url, (access or _PLAIN).key())
    with _LOCK:
        if key not in _FILESYSTEMS:
            _FILESYSTEMS[key] = filesystem(url, access)
        return _FILESYSTEMS[key]


def attempt(read, what: str, url: str, retries: int, state: dict | None = None):
    """``read()`` with retries, each failure classed
    (pycls.datasets.transport.http_files.attempt)."""
    return http_files.attempt(read, what, url, retries, state)


# ------------------------------------------------------------------------------------------------ #
# Files: sizes, identities, file objects, listings
# ------------------------------------------------------------------------------------------------ #


def open_local(path: str) -> int:
    """A read descriptor of a local file; DataPathError when it is not there."""
    try:
        return os.open(local_path(path), os.O_RDONLY)
    except FileNotFoundError:
        raise DataPathError(f"{printable_path(path)} does not exist") from None
    except OSError as err:
        raise DataReadError(f"cannot read {printable_path(path)}: {err}") from None


def _stat(path: str) -> os.stat_result:
    try:
        return os.stat(local_path(path))
    except FileNotFoundError:
        raise DataPathError(f"{printable_path(path)} does not exist") from None
    except OSError as err:
        raise DataReadError(f"cannot read {printable_path(path)}: {err}") from None


# Per process: what a URL's server said of it (size, identity)
_INFO: dict = {}


def _info(path: str, retries: int, access: Access | None) -> dict:
    key = (os.getpid(), path)
    if key in _INFO:
        return _INFO[key]
    if is_http(path):
        http_session = session(access)
        info = attempt(lambda: http_session.info(path), printable_path(path), path, retries)
    else:
        fs, fs_path = fs_for(path, access)
        raw = attempt(lambda: fs.info(fs_path), printable_path(path), path, retries)
        tag = next((raw[k] for k in ("ETag", "etag", "LastModified", "mtime", "last_commit") if
                    raw.get(k)), "")  # fmt: skip
        info = {"size": int(raw.get("size") or 0), "identity": str(tag)}
    _INFO[key] = info
    return info


def file_size(path: str, retries: int = 3, access: Access | None = None) -> int:
    """The size in bytes of a local file or a URL."""
    if not is_url(path):
        return _stat(path).st_size
    return int(_info(path, retries, access)["size"])


def file_identity(path: str, retries: int = 3, access: Access | None = None) -> str:
    """What changes when the file does, for the caches of what was read from it: a local file's
    size, modification and change times and inode (a rewrite that keeps the size and sets the
    modification time back, as ``touch -r`` or ``cp -p`` do, still moves the change time, which
    nothing can set back; a file moved over it has another inode), a URL's size and ETag (else
    Last-Modified)."""
    if not is_url(path):
        st = _stat(path)
        return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_dev}:{st.st_ino}"
    info = _info(path, retries, access)
    return f"{info['size']}:{info['identity']}"


def file_conditions(path: str, retries: int = 3, access: Access | None = None) -> dict:
    """The request headers that make ``path``'s server refuse (412) a file other than the one it
    described when first asked in this process (``http_files.conditions``); none for other
    protocols (fsspec reads them) or a server that sent no ETag or Last-Modified."""
    if not is_http(path):
        return {}
    return http_files.conditions(_info(path, retries, access))


def serves_ranges(url: str, access: Access | None = None, retries: int = 3, ask=True) -> bool:
    """Whether ``url``'s server answers byte ranges (always for local paths and protocols other
    than http(s); ``ask`` False: only what this process has seen so far)."""
    if not is_http(url):
        return True
    http_session = session(access)
    if not ask:
        return http_files.split_url(url)[0] not in http_session.no_ranges
    return attempt(lambda: http_session.serves_ranges(url), printable_path(url), url, retries)


def too_large_without_ranges(path: str, size: int, limit: int) -> DataPathError:
    """The refusal of a parquet file served without byte ranges, larger than the bound."""
    return DataPathError(
        f"{printable_path(path)} is served without byte ranges and holds {size:,} bytes, more "
        f"than DATA_LOADER.READAHEAD_MB ({limit / 2**20:g} MiB) lets a process keep: a parquet "
        "file is read by row group from its footer, which needs ranges; serve it from a server "
        "with ranges, copy it to disk, or raise DATA_LOADER.READAHEAD_MB"
    )


def list_files(path: str, max_depth: int = 2, access: Access | None = None) -> list[str]:
    """The files in a local folder or a URL's folder and its sub-folders, ``max_depth`` levels
    in all, sorted, named as ``path`` names them (URLs keep their protocol). A folder that is not
    there is a DataPathError; a server that cannot be reached a DataReadError."""
    if not is_url(path):
        root = local_path(path)
        if not os.path.isdir(root):
            raise DataPathError(f"{printable_path(path)} is not a folder (it does not exist)" if
                                not os.path.exists(root) else f"{printable_path(path)} is not a "
                                "folder")  # fmt: skip
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            depth = os.path.relpath(dirpath, root).count(os.sep) + (dirpath != root)
            if depth >= max_depth - 1:  # as fsspec's find: max_depth 1 is the folder's own files
                dirnames[:] = []
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            found += [os.path.join(dirpath, f) for f in filenames]
        return sorted(found)
    if is_http(path):
        return _http_find(path, max_depth, access)
    fs, fs_path = fs_for(path, access)
    retries = (access or _PLAIN).retries
    names = attempt(
        lambda: fs.find(fs_path, maxdepth=max_depth), printable_path(path), path, retries
    )
    protocol = path.split("://", 1)[0]
    return sorted(f"{protocol}://{name}" for name in names)


def _http_find(url: str, max_depth: int, access: Access | None) -> list[str]:
    http_session, retries = session(access), (access or _PLAIN).retries
    found, folders = [], [url]
    for _ in range(max(1, max_depth)):
        deeper = []
        for folder in folders:
            files, subs = attempt(
                lambda f=folder: http_session.listing(f), printable_path(folder), folder, retries
            )
            found += files
            deeper += [s for s in subs if not s.rstrip("/").rsplit("/", 1)[-1].startswith(".")]
        folders = deeper
    return sorted(set(found))


def glob_files(pattern: str, access: Access | None = None) -> list[str]:
    """The files a glob pattern (``*``, ``?``) matches, local or URL."""
    if not is_url(pattern):
        return sorted(glob.glob(local_path(pattern)))
    if is_http(pattern):
        head = re.split(r"[*?\[]", pattern, maxsplit=1)[0].rsplit("/", 1)[0]
        depth = pattern[len(head) :].count("/")
        return [f for f in _http_find(head, depth, access) if fnmatch.fnmatchcase(f, pattern)]
    fs, fs_path = fs_for(pattern, access)
    protocol = pattern.split("://", 1)[0]
    retries = (access or _PLAIN).retries
    names = attempt(lambda: fs.glob(fs_path), printable_path(pattern), pattern, retries)
    return sorted(f"{protocol}://{name}" for name in names)


def isdir(path: str, access: Access | None = None) -> bool:
    """Whether ``path`` is a folder (for a URL: whether it lists any file); a URL that cannot be
    reached or does not exist raises (DataReadError, DataPathError)."""
    if not is_url(path):
        return os.path.isdir(local_path(path))
    if is_http(path):
        return bool(_http_find(path, 1, access))
    fs, fs_path = fs_for(path, access)
    retries = (access or _PLAIN).retries
    return bool(attempt(lambda: fs.isdir(fs_path), printable_path(path), path, retries))
