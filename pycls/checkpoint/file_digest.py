"""The SHA-256 of a weights file or a checkpoint folder, as a run records which file it read (a
distillation teacher), cached by path, size, modification and change times, device and inode so
that a multi-GB file is read once, not at every start.

The cache is one small JSON file per path in ``digests/`` of pycls's cache folder
($PYCLS_CACHE_DIR, else $XDG_CACHE_HOME/pycls, else ~/.cache/pycls). A file rewritten in place
with its size and modification time kept (``touch -r``, ``cp -p`` of a same-sized file) is hashed
again: the write, and setting the time back, both move its change time, which no tool can set
back; a file moved over it has another inode. The key costs nothing more than the one ``stat``
it always took. What moves the change time without a write (``chmod``, a new hard link) costs
one hash more; what it cannot see: a change made with the clock set back and the file system's
change time forged (by hand, on the raw device).
"""

import hashlib
import json
import logging
import os
from pathlib import Path

from pycls.atomic_files import write_text_atomic

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22
# 2: keyed by the change time, device and inode too (a version-1 record is hashed again)
_VERSION = 2


def cache_dir() -> Path:
    if os.environ.get("PYCLS_CACHE_DIR"):
        return Path(os.environ["PYCLS_CACHE_DIR"]) / "digests"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pycls" / "digests"


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cached(path: str, folder: Path) -> str:
    st = os.stat(path)
    key = {"version": _VERSION, "path": os.path.realpath(path), "size": st.st_size,
           "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "dev": st.st_dev,
           "inode": st.st_ino}  # fmt: skip
    record = folder / f"{hashlib.sha256(key['path'].encode()).hexdigest()[:20]}.json"
    try:
        saved = json.loads(record.read_text())
        same = isinstance(saved, dict) and {k: saved.get(k) for k in key} == key
        if same and isinstance(saved.get("sha256"), str):
            return saved["sha256"]
    except (OSError, ValueError):
        pass
    digest = _hash_file(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, json.dumps({**key, "sha256": digest}))
    except OSError as err:  # a cache that cannot be written: hashed again next time
        logger.debug(f"cannot keep the digest of {path} in {folder}: {err}")
    return digest


def digest(path: str, folder: str | os.PathLike | None = None) -> str:
    """The SHA-256 (hex) of the file ``path``; of a folder, of its files' relative paths and
    digests, sorted. ``folder``: where digests are cached (default ``cache_dir()``)."""
    where = Path(folder) if folder else cache_dir()
    if not os.path.isdir(path):
        return _cached(path, where)
    lines = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            lines.append(f"{os.path.relpath(full, path)}\t{_cached(full, where)}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()
