"""Tiny HTTP servers on 127.0.0.1 for the tests of reading data from URLs, each in a thread of
the test process: one that serves byte ranges, one that ignores them on purpose (as Python's own
``http.server`` does, also served as it is), one that answers what a test tells it to (an
error status, a stall, a trickle) a given number of times before it serves the file, and ones
that send validators (ETag, Last-Modified) and answer 412 to a request whose condition a changed
file no longer meets."""

import email.utils
import functools
import hashlib
import http.server
import os
import socket
import threading
import time


class Quiet:
    """No request log, and no traceback for a client that hangs up (a loader worker exits with
    its connection kept alive)."""

    def log_message(self, *args):
        pass


class RangeHandler(Quiet, http.server.SimpleHTTPRequestHandler):
    """Files with byte ranges (``Range: bytes=a-b`` and ``bytes=a-``), kept-alive connections,
    HEAD, and the folder listings of the standard library."""

    protocol_version = "HTTP/1.1"
    ranges = True
    etag = False  # an ETag (a digest of the file's bytes), and If-Match answered
    last_modified = False  # Last-Modified (the file's time), and If-Unmodified-Since answered

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _scripted(self):
        """What the server's script says to answer this request instead, or None; 403 without
        the server's token (``Authorization: Bearer TOKEN``), when it has one."""
        token = self.server.token
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            return 403
        return self.server.next_trouble(self.path, self)

    def _serve(self, head):
        trouble = self._scripted()
        if trouble in ("trickle", "drop") and not head:
            return self._trickle(drop=trouble == "drop")
        if trouble == "stall":
            self.server.release.wait(30)
            self.close_connection = True
            return
        if isinstance(trouble, int):
            body = f"scripted {trouble}".encode()
            self.send_response(trouble)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(b"" if head else body)
            return
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            return super().do_HEAD() if head else super().do_GET()
        if not os.path.isfile(path):
            return self.send_error(404)
        validators = self._validators(path)
        if self._precondition_failed(path, validators):
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        start, end = 0, size - 1
        ranged = self.ranges and self.headers.get("Range", "").startswith("bytes=")
        if ranged:
            first, last = self.headers["Range"][6:].split("-")
            start, end = int(first or 0), min(int(last) if last else size - 1, size - 1)
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(end - start + 1))
        if self.ranges:
            self.send_header("Accept-Ranges", "bytes")
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for name, value in validators.items():
            self.send_header(name, value)
        self.end_headers()
        if head:
            return
        self.server.count(self.path, ranged)
        with open(path, "rb") as f:
            f.seek(start)
            self.wfile.write(f.read(end - start + 1))

    def _trickle(self, drop=False):
        """The file asked for (a range of it where asked), its headers stating its whole length:
        half the body at once, then a byte every ``trickle_pause`` seconds, for at most
        ``trickle_for`` seconds (then the connection is closed); ``drop``: closed after the
        half (a connection reset mid-answer)."""
        path = self.translate_path(self.path)
        with open(path, "rb") as f:
            body = f.read()
        ranged = self.headers.get("Range", "").startswith("bytes=")
        size = len(body)
        if ranged:
            first, last = self.headers["Range"][6:].split("-")
            start, end = int(first or 0), min(int(last) if last else size - 1, size - 1)
            body = body[start : end + 1]
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(len(body)))
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        self.close_connection = True
        half, began = len(body) // 2, time.monotonic()
        try:
            self.wfile.write(body[:half])
            self.wfile.flush()
            if drop:
                return
            self.server.trickling.set()
            for at in range(half, len(body)):
                if self.server.release.wait(self.server.trickle_pause):
                    return
                if time.monotonic() - began > self.server.trickle_for:
                    return
                self.wfile.write(body[at : at + 1])
                self.wfile.flush()
        except OSError:  # the client gave up: what a deadline is for
            return

    def _validators(self, path):
        out = {}
        if self.etag:
            with open(path, "rb") as f:
                out["ETag"] = '"' + hashlib.sha256(f.read()).hexdigest()[:16] + '"'
        if self.last_modified:
            out["Last-Modified"] = self.date_time_string(int(os.path.getmtime(path)))
        return out

    def _precondition_failed(self, path, validators):
        match = self.headers.get("If-Match")
        if match is not None and "ETag" in validators and match != validators["ETag"]:
            return True
        since = self.headers.get("If-Unmodified-Since")
        if since is not None and "Last-Modified" in validators:
            since = email.utils.parsedate_to_datetime(since).timestamp()
            return int(os.path.getmtime(path)) > since
        return False


class ETagHandler(RangeHandler):
    """Byte ranges, an ETag on every answer, If-Match answered (412 for another ETag)."""

    etag = True


class LastModifiedHandler(RangeHandler):
    """Byte ranges, Last-Modified on every answer, If-Unmodified-Since answered (412)."""

    last_modified = True


class NoRangeHandler(RangeHandler):
    """The same files, every Range header ignored: status 200 and the whole file."""

    ranges = False


class StdlibHandler(Quiet, http.server.SimpleHTTPRequestHandler):
    """Python's own file server as it is (it answers a Range request with the whole file)."""


class Server(http.server.ThreadingHTTPServer):
    """Serves ``root`` with ``handler`` on 127.0.0.1 in a thread (``with Server(...) as s``).
    ``script``: answers to give before serving files, in order (an HTTP status; "stall": no
    answer until ``release`` is set; "trickle": half the file, then a byte every
    ``trickle_pause`` s for at most ``trickle_for`` s, ``trickling`` set when it starts; "drop":
    half the file, then the connection closed), for
    the requests ``picks(path, handler)`` picks (default: paths ending in ``scripted``).
    ``requests`` counts the file answers: (path, ranged) -> count."""

    daemon_threads = True

    def __init__(self, root, handler=RangeHandler, script=(), scripted=""):
        super().__init__(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
        self.script, self.scripted = list(script), scripted
        self.picks = lambda path, handler: path.endswith(self.scripted)
        self.release, self.trickling = threading.Event(), threading.Event()
        self.trickle_pause, self.trickle_for = 0.2, 60.0
        self.requests: dict = {}
        self.lock = threading.Lock()
        self.token = ""  # set: only requests carrying it are served

    def handle_error(self, request, client_address):
        pass  # a client that hung up mid-answer: nothing to report

    def next_trouble(self, path, handler=None):
        with self.lock:
            if self.script and self.picks(path, handler):
                return self.script.pop(0)
        return None

    def count(self, path, ranged):
        with self.lock:
            self.requests[(path, ranged)] = self.requests.get((path, ranged), 0) + 1

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.shutdown()
        self.server_close()

    def url(self, path=""):
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"


def closed_port():
    """A port on 127.0.0.1 that nothing listens on (connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
