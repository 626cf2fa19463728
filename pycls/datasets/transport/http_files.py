"""Files at http:// and https:// URLs, read with the standard library's ``http.client``: one
kept-alive connection per thread and server, byte ranges where the server serves them, whole
files streamed where it does not, redirects followed, and every failure named with whose it is.

Why not fsspec's http file system (aiohttp) here: it takes a range's answer whatever the server sent
(a server without ranges sent the whole file for every sample, and the read failed as short), it
reports a refused connection as a missing file, and what a failure was (404, 403, a timeout, a 5xx)
is lost in its exceptions; here each is named and classed, and a small range costs a fraction of a
millisecond on the loopback (BENCHMARKS.md, "Data loader: streaming over HTTP"). Other protocols
(hf://, s3://, gs://) stay with fsspec (pycls.datasets.transport.remote_files).

- ``Session``: the connections of one process, the request headers (a token: sent to the server
  the URL names, never to another one a redirect points at, never logged), and which servers were
  found to serve no ranges (a Range request answered with status 200 and the whole file).
- Every request is an attempt of ``pycls.datasets.transport.read_attempts.attempt`` (the one retry
  policy, re-exported here) and its answer is counted toward the attempt's deadline
  (``pycls.datasets.transport.read_deadlines``): a server silent or trickling below the floor is
  cut, and so is a read still waiting seconds after a stop signal.
- ``StreamedFile``: a file read from its start in one request (indexing a tar shard, a whole
  shard from a server without ranges), resumed where it broke when the connection drops.
- A folder's listing keeps the links that lie below it once decoded and normalised
  (``pycls.datasets.transport.url_paths.below``: ``%2e%2e/`` cannot climb out behind an undecoded
  prefix).
- What was indexed is what is read: a read may carry the validator recorded when its file was
  indexed (``conditions``: ``If-Match`` with a strong ETag, else ``If-Unmodified-Since`` with
  Last-Modified), so that a file changed since answers 412 instead of other bytes; and the size
  an answer states for the whole file (Content-Range, or a whole file's Content-Length) must be
  the size indexed. Either is a ``DataChangedError`` naming the URL, never retried.
"""

import contextlib
import http.client
import io
import logging
import os
import re
import socket
import threading
from html import unescape
from urllib.parse import quote, urljoin, urlsplit

from pycls.datasets.transport import read_deadlines, url_paths
from pycls.datasets.transport.read_attempts import (  # noqa: F401 (the names this module has always had)
    MAX_RETRY_PAUSE,
    RETRY_PAUSE,
    attempt,
    classify,
    retry_pause,
    total_pause,
)
from pycls.datasets.transport.read_errors import (  # noqa: F401 (as above)
    DataChangedError,
    DataPathError,
    HTTPStatusError,
    ShortAnswer,
)
from pycls.errors import printable_path

logger = logging.getLogger(__name__)

# The defaults of an attempt's window (seconds; a server silent that long fails it) and floor
# (bytes a second over each window): pycls.datasets.transport.read_deadlines
READ_TIMEOUT = read_deadlines.READ_TIMEOUT
MIN_READ_RATE = read_deadlines.MIN_READ_RATE
_MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
# The most a folder's listing page may hold, and what is read of an error's body (to keep the
# connection for the next request)
_MAX_LISTING_BYTES = 32 << 20
_MAX_DISCARD = 64 << 10
_CHUNK = 1 << 20
# What a streamed file keeps behind its position: tarfile reads the byte before each header
_LOOK_BEHIND = 64 << 10


def split_url(url: str) -> tuple[tuple[str, str, int], str]:
    """((scheme, host, port), request target) of an http(s) URL; DataPathError when it is not a
    URL one can ask (no host, a port that is not one)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as err:
        raise DataPathError(f"{printable_path(url)} is not a valid URL ({err})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DataPathError(f"{printable_path(url)} is not a valid URL (it names no server)")
    port = port or (443 if parts.scheme == "https" else 80)
    # Spaces and other bytes a request line cannot hold are quoted; %XX already there is kept
    target = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        target += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return (parts.scheme, parts.hostname, port), target


def _server_words(server) -> str:
    return f"{server[1]}:{server[2]}"


def _content_range(resp) -> tuple[int | None, int | None]:
    """(first byte, file size) of a 206 answer's Content-Range, None where absent."""
    match = re.match(r"bytes (\d+)-\d+/(\d+|\*)", resp.getheader("Content-Range") or "")
    if not match:
        return None, None
    total = match.group(2)
    return int(match.group(1)), (int(total) if total != "*" else None)


def conditions(info: dict) -> dict:
    """The request headers that make a server refuse (412) a file other than the one ``info``
    describes (``Session.info`` when it was indexed): ``If-Match`` with its ETag where it is
    strong (a weak one never matches by the rules of If-Match), else ``If-Unmodified-Since``
    with its Last-Modified; none where the server sent neither."""
    etag, modified = info.get("etag") or "", info.get("modified") or ""
    if etag and not etag.startswith("W/"):
        return {"If-Match": etag}
    if modified:
        return {"If-Unmodified-Since": modified}
    return {}


def _refused_condition(url: str, sent: dict) -> DataChangedError:
    if "If-Match" in sent:
        why = f"its ETag is no longer {sent['If-Match']}"
    else:
        why = f"it was modified after {sent.get('If-Unmodified-Since')}"
    return DataChangedError(url, f"the server answered HTTP 412 Precondition Failed ({why})")


def _stated_size(resp) -> int | None:
    """The size of the whole file an answer states: Content-Range's total (206), else the
    Content-Length of a whole file (200)."""
    if resp.status == 206:
        return _content_range(resp)[1]
    length = resp.getheader("Content-Length")
    return int(length) if length is not None and length.isdigit() else None


def check_size(url: str, resp, size: int | None) -> None:
    """A DataChangedError where ``resp`` states another size of the file than ``size`` (the
    size indexed; None: not known)."""
    stated = _stated_size(resp)
    if size is not None and stated is not None and stated != size:
        raise DataChangedError(
            url, f"the server states {stated:,} bytes, {size:,} when it was indexed"
        )


def _read_exactly(resp, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = resp.read(min(_CHUNK, size - got))
        if not chunk:
            raise http.client.IncompleteRead(b"".join(chunks), size - got)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _skip(resp, count: int) -> None:
    while count > 0:
        chunk = resp.read(min(_CHUNK, count))
        if not chunk:
            raise ShortAnswer(f"the file ended {count} bytes before the range asked for")
        count -= len(chunk)


def _send(conn, method: str, target: str, headers: dict) -> None:
    """Sends a request, then asks the kernel to acknowledge the answer's first packet at once
    (Linux's TCP_QUICKACK). A server that writes an answer's headers and its body separately
    without TCP_NODELAY (Python's own http.server, many small ones) holds the body until the
    headers are acknowledged, which a receiver that sends nothing delays by 40 ms: a range of a
    few KB then took 44 ms instead of 0.6 ms on loopback (measured)."""
    conn.request(method, target, headers=headers)
    conn.pycls_watch()  # the answer counts toward the attempt; a cut shuts it
    quick = getattr(socket, "TCP_QUICKACK", None)
    if quick is not None and conn.sock is not None:
        with contextlib.suppress(OSError):  # a socket that does not take it: the answer is late
            conn.sock.setsockopt(socket.IPPROTO_TCP, quick, 1)


class Session:
    """The http(s) connections of one process: one kept alive per thread and server. ``headers``
    go with every request to the server a URL names (not to another one a redirect leads to).
    ``no_ranges`` holds the servers seen answering a Range request with the whole file.
    ``read_timeout`` and ``min_rate``: each attempt's window and floor (``read_deadlines``)."""

    def __init__(self, headers: dict | None = None, read_timeout: float = READ_TIMEOUT,
                 min_rate: float = MIN_READ_RATE):  # fmt: skip
        self.headers = dict(headers or {})
        self.read_timeout, self.min_rate = float(read_timeout), float(min_rate)
        self.no_ranges: set = set()
        self._local = threading.local()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"headers": self.headers, "no_ranges": set(self.no_ranges),
                "limits": (self.read_timeout, self.min_rate)}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["headers"], *state["limits"])
        self.no_ranges = state["no_ranges"]

    def _connections(self) -> dict:
        if getattr(self._local, "pid", None) != os.getpid():  # a forked child's own sockets
            self._local.pid, self._local.connections = os.getpid(), {}
        return self._local.connections

    def _connection(self, server, dedicated: bool):
        pool = self._connections()
        conn = None if dedicated else pool.get(server)
        if conn is not None and conn.pycls_cut:  # an attempt's deadline shut it
            self.drop(server, conn)
            conn = None
        if conn is None:
            scheme, host, port = server
            kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = kind(host, port, timeout=self.read_timeout)
            conn.response_class = read_deadlines.CountedResponse
            conn.pycls_used = conn.pycls_cut = False
            conn.pycls_watch = lambda: self.watch(conn, server)
            if not dedicated:
                pool[server] = conn
        return conn

    def watch(self, conn, server) -> None:
        """``conn`` serves the attempt this thread runs: held to its window and floor."""
        sock = conn.sock
        if sock is None:
            return

        def end():
            conn.pycls_cut = True  # never used again: what it was answering is lost
            read_deadlines.shut(sock)

        read_deadlines.link(end, self.read_timeout, self.min_rate, _server_words(server))

    def drop(self, server, conn) -> None:
        """Closes ``conn`` (an answer not read to its end leaves it unusable)."""
        conn.close()
        pool = self._connections()
        if pool.get(server) is conn:
            del pool[server]

    def _exchange(self, server, method, target, headers, dedicated):
        conn = self._connection(server, dedicated)
        try:
            _send(conn, method, target, headers)
            resp = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.drop(server, conn)
            if not conn.pycls_used:
                raise
            # A kept-alive connection the server closed while idle: once more on a new one
            conn = self._connection(server, dedicated)
            try:
                _send(conn, method, target, headers)
                resp = conn.getresponse()
            except BaseException:
                self.drop(server, conn)
                raise
        except BaseException:
            self.drop(server, conn)
            raise
        conn.pycls_used = True
        return resp, conn

    def request(self, url: str, headers: dict | None = None, method: str = "GET", *,
                dedicated: bool = False):  # fmt: skip
        """(answer, server, connection) of ``url``, redirects followed. An error status raises
        HTTPStatusError. The caller reads the answer to its end, or drops the connection;
        ``dedicated``: a connection of its own (a stream that stays open), closed after."""
        origin, asked = split_url(url)[0], url
        for _ in range(_MAX_REDIRECTS + 1):
            server, target = split_url(url)
            sent = {**self.headers, **(headers or {})} if server == origin else dict(headers or {})
            resp, conn = self._exchange(server, method, target, sent, dedicated)
            location = resp.getheader("Location")
            if resp.status in _REDIRECTS and location:
                self.finish(server, conn, resp)
                url = urljoin(url, location)
                continue
            if resp.status >= 400:
                self.finish(server, conn, resp)
                if resp.status == 412 and ("If-Match" in sent or "If-Unmodified-Since" in sent):
                    raise _refused_condition(asked, sent)
                raise HTTPStatusError(resp.status, resp.reason or "")
            return resp, server, conn
        raise DataPathError(f"{printable_path(url)}: more than {_MAX_REDIRECTS} redirects")

    def finish(self, server, conn, resp) -> None:
        """Reads a short answer to its end to keep the connection; drops a long one."""
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) <= _MAX_DISCARD:
            try:
                resp.read()
                return
            except (OSError, http.client.HTTPException):
                pass
        self.drop(server, conn)

    # -- what is read ------------------------------------------------------------------------- #
    def read_range(self, url: str, start: int, size: int, conditions: dict | None = None,
                   file_size: int | None = None) -> bytes:  # fmt: skip
        """``size`` bytes of ``url`` from ``start`` (one attempt). A server that answers with the
        whole file is recorded in ``no_ranges`` and the bytes are cut from its answer.
        ``conditions`` (``conditions()`` of the file as indexed) go with the request, and the
        size the answer states must be ``file_size`` where given (else DataChangedError)."""
        headers = {"Range": f"bytes={start}-{start + size - 1}", **(conditions or {})}
        resp, server, conn = self.request(url, headers)
        try:
            check_size(url, resp, file_size)
            if resp.status == 206:
                first, _ = _content_range(resp)
                if first is not None and first != start:
                    raise ShortAnswer(f"the server answered bytes from {first}, not {start}")
                data = resp.read()
                if len(data) != size:
                    raise ShortAnswer(f"the server answered {len(data)} bytes instead of {size}")
                return data
            length = resp.getheader("Content-Length")
            if start > 0 or (length is not None and length.isdigit() and int(length) != size):
                self.mark_no_ranges(server, url, resp.status)
            _skip(resp, start)
            return _read_exactly(resp, size)
        finally:
            if not resp.isclosed():
                self.drop(server, conn)

    def mark_no_ranges(self, server, url: str, status: int) -> None:
        with self._lock:
            if server in self.no_ranges:
                return
            self.no_ranges.add(server)
        logger.warning(
            f"{_server_words(server)} serves no byte ranges (a Range request for "
            f"{printable_path(url)} was answered with status {status} and the whole file): its "
            'files are read whole, streamed from their start (docs/data_formats.md, "Servers '
            'without byte ranges")'
        )

    def serves_ranges(self, url: str) -> bool:
        """Whether the server of ``url`` answers a Range request with that range (one attempt:
        its first byte)."""
        server = split_url(url)[0]
        if server in self.no_ranges:
            return False
        resp, server, conn = self.request(url, {"Range": "bytes=0-0"})
        try:
            if resp.status == 206:
                resp.read()
                return True
        finally:
            if not resp.isclosed():
                self.drop(server, conn)
        self.mark_no_ranges(server, url, resp.status)
        return False

    def info(self, url: str) -> dict:
        """``size``, ``identity`` (ETag, else Last-Modified), ``etag`` and ``modified`` of
        ``url`` (one attempt): a HEAD request, or the headers of a GET where HEAD is not served."""
        try:
            resp, server, conn = self.request(url, method="HEAD")
            resp.read()
            size = resp.getheader("Content-Length")
        except HTTPStatusError as err:
            if err.status not in (405, 501):
                raise
            resp, server, conn = self.request(url, {"Range": "bytes=0-0"})
            size = _content_range(resp)[1] if resp.status == 206 else None
            size = size if size is not None else resp.getheader("Content-Length")
            self.drop(server, conn)
        if size is None or not str(size).isdigit():
            raise ShortAnswer(f"the server did not say the size of {printable_path(url)}")
        etag, modified = resp.getheader("ETag") or "", resp.getheader("Last-Modified") or ""
        return {"size": int(size), "identity": etag or modified, "etag": etag,
                "modified": modified}  # fmt: skip

    def listing(self, url: str) -> tuple[list[str], list[str]]:
        """(files, folders) a folder's page links to below it, as URLs (one attempt)."""
        folder = url if url.endswith("/") else url + "/"
        resp, server, conn = self.request(folder)
        try:
            page = resp.read(_MAX_LISTING_BYTES + 1)
        finally:
            if not resp.isclosed():
                self.drop(server, conn)
        if len(page) > _MAX_LISTING_BYTES:
            raise DataPathError(
                f"{printable_path(folder)} lists more than {_MAX_LISTING_BYTES >> 20} MiB: not a "
                "folder's page"
            )
        text = page.decode("utf-8", errors="replace")
        files, folders = set(), set()
        for link in re.findall(r"""href\s*=\s*["']([^"'#?]+)""", text, flags=re.IGNORECASE):
            target = url_paths.below(folder, urljoin(folder, unescape(link)))
            if target is None:
                continue  # the parent, another server, a sorting link, one that climbs out
            (folders if target.endswith("/") else files).add(target)
        return sorted(files), sorted(folders)


class StreamedFile(io.RawIOBase):
    """A URL's file read from its start in one request, for readers that go through a file once
    (tarfile indexing a shard; a whole shard from a server without ranges). Seeking forward
    skips; a short look back is kept. A dropped connection is resumed where it broke (a range
    from there, or the whole file again, skipped to it), up to ``retries`` attempts.

    ``conditions`` go with every request (the file as indexed: ``conditions()``), and every answer
    must state the file's ``size`` where given: a file that changed is a DataChangedError, never
    two versions stitched together. ``hasher`` (a hashlib object, set before the first read) is
    fed every byte of the file once, in order, as it comes. ``state``: as ``attempt``'s."""

    def __init__(self, session: Session, url: str, retries: int, size: int | None = None,
                 conditions: dict | None = None, state: dict | None = None):  # fmt: skip
        super().__init__()
        self.session, self.url, self.retries, self.size = session, url, max(1, retries), size
        self.conditions, self.hasher, self.state = dict(conditions or {}), None, state
        self._pos = self._streamed = 0  # where the reader is; how much came from the server
        self._behind, self._resp, self._server, self._conn = b"", None, None, None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def _open(self) -> None:
        """A request from what came so far: a range where the server serves them, else the
        whole file skipped to it."""
        at = self._streamed
        ranges = at > 0 and split_url(self.url)[0] not in self.session.no_ranges
        headers = {**self.conditions, **({"Range": f"bytes={at}-"} if ranges else {})}
        resp, self._server, self._conn = self.session.request(self.url, headers, dedicated=True)
        self._resp = resp
        check_size(self.url, resp, self.size)
        if resp.status != 206 and at:
            _skip(resp, at)

    def _drop(self) -> None:
        if self._conn is not None:
            self.session.drop(self._server, self._conn)
        self._resp = self._conn = None

    def _read_some(self, size: int) -> bytes:
        def read():
            try:
                if self._resp is None:
                    self._open()
                else:  # the answer read on: held to this attempt's deadline
                    self._conn.pycls_watch()
                data = self._resp.read(size)
                if self._conn.pycls_cut:  # cut short by the deadline: asked again from here
                    self._drop()
                elif not data and size and self.size is not None and self._streamed < self.size:
                    raise ShortAnswer(
                        f"the answer ended {self.size - self._streamed:,} bytes before the "
                        "file's end"
                    )
                return data
            except BaseException:
                self._drop()
                raise

        return attempt(read, printable_path(self.url), self.url, self.retries, self.state)

    def _network(self, size: int) -> bytes:
        """Up to ``size`` new bytes from the answer (b"" at the file's end)."""
        data = self._read_some(size)  # an answer that ends early is asked again from there
        self._streamed += len(data)
        self._behind = (self._behind + data)[-_LOOK_BEHIND:]
        if self.hasher is not None:
            self.hasher.update(data)
        return data

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return b"".join(iter(lambda: self.read(_CHUNK), b""))
        if self._pos < self._streamed:  # after a short seek back: from what was kept
            kept = self._behind[len(self._behind) - (self._streamed - self._pos) :][:size]
            self._pos += len(kept)
            return kept
        data = self._network(size) if size else b""
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            target = offset
        elif whence == io.SEEK_CUR:
            target = self._pos + offset
        elif self.size is not None:
            target = self.size + offset
        else:
            raise io.UnsupportedOperation("a streamed URL of unknown size is not read from its end")
        if target < self._streamed - len(self._behind):
            raise io.UnsupportedOperation(
                f"cannot go back to byte {target} of a streamed URL (at {self._pos})"
            )
        while target > self._streamed:
            if not self._network(min(_CHUNK, target - self._streamed)):
                break
        self._pos = min(target, self._streamed)
        return self._pos

    def close(self) -> None:
        self._drop()
        super().close()
