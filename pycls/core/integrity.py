"""Integrity of what pycls writes: file checksums, folder manifests, write errors, class lists,
and the list of skipped corrupt files.

- ``file_record`` / ``verify_file``: a file's size and CRC32, checked before it is trusted.
- ``write_manifest`` / ``verify_manifest``: ``manifest.json`` in a folder (a sharded checkpoint)
  listing every file with its size and CRC32; a missing, truncated or altered file fails with
  ``CorruptFileError`` naming it.
- ``describe_write_error``: one line for a failed write (disk full, read-only, quota), with the
  path and the cause.
- ``check_classes``: a test split whose class folders differ from the training split's.
- ``SkippedFiles``: the corrupt samples a run skipped (``DATA_LOADER.SKIP_CORRUPT``), named in
  the log (the first few) and in ``OUT_DIR/skipped_files.txt`` (all of them).

Leaf code: nothing here reads the global config.
"""

import contextlib
import errno
import json
import logging
import os
import zlib

from pycls.core.errors import one_line

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class CorruptFileError(ValueError):
    """A file is missing, or its size or checksum differs from the one recorded when written."""


class ClassMismatchError(ValueError):
    """The test split's classes differ from the training split's (labels would shift)."""


def crc32_of_file(path):
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_record(path):
    """{"size": bytes, "crc32": checksum} of a file."""
    return {"size": os.path.getsize(path), "crc32": crc32_of_file(path)}


def verify_file(path, record, what="file"):
    """Raises CorruptFileError naming ``path`` unless it has the recorded size and checksum."""
    if not os.path.isfile(path):
        raise CorruptFileError(f"{what} {path} is missing")
    size = os.path.getsize(path)
    if size != record["size"]:
        raise CorruptFileError(
            f"{what} {path} is {size} bytes, {record['size']} were written (truncated or altered)"
        )
    if "crc32" in record and crc32_of_file(path) != record["crc32"]:
        raise CorruptFileError(f"{what} {path} is corrupt: its contents fail the CRC32 check")


def write_manifest(folder, exclude=()):
    """Records every file under ``folder`` (relative paths) in ``folder/manifest.json``."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST and rel not in exclude:
                files[rel] = file_record(os.path.join(folder, rel))
    data = json.dumps({"version": 1, "files": dict(sorted(files.items()))}, indent=1)
    write_text_atomic(os.path.join(folder, MANIFEST), data)
    return files


def read_manifest(folder):
    """The manifest's {relative path: record}, or None when the folder has none."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        return {
            str(k): {"size": int(v["size"]), "crc32": int(v["crc32"])} for k, v in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptFileError(f"manifest {path} is unreadable: {type(e).__name__}: {e}") from None


def verify_manifest(folder):
    """Checks every file the manifest lists; returns False when there is no manifest (a folder
    written before manifests existed), True when all files verify."""
    files = read_manifest(folder)
    if files is None:
        return False
    for rel, record in files.items():
        verify_file(os.path.join(folder, rel), record)
    return True


@contextlib.contextmanager
def atomic_file(path, mode="w"):
    """Yields a file that replaces ``path`` only once it is whole: written under a temporary name
    (``PATH.tmp.PID``, which start-up clean-up recognises), flushed to disk, renamed. A failed or
    interrupted write leaves ``path`` as it was."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path, text):
    with atomic_file(path) as f:
        f.write(text)


def os_error_in(exc):
    """The OSError behind ``exc`` (itself, or one in its cause/context chain), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def describe_write_error(path, exc):
    """One line for a failed write of ``path``: the cause in words, without a traceback."""
    os_err = os_error_in(exc)
    if os_err is not None and os_err.errno is not None:
        cause = os.strerror(os_err.errno)
        if os_err.errno in (errno.ENOSPC, errno.EDQUOT):
            cause += " (free some space or choose another OUT_DIR)"
        return f"cannot write {path}: {cause} [{errno.errorcode.get(os_err.errno, os_err.errno)}]"
    return f"cannot write {path}: {type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------------------ #
# Class lists
# ------------------------------------------------------------------------------------------------ #


def check_classes(train_classes, test_classes, where):
    """Raises ClassMismatchError listing the classes missing from or extra in the test split.

    ``where`` names the two sources (e.g. "train split /data/train vs test split /data/val").
    None on either side (a data set without class names, such as CIFAR) is not checked.
    """
    if train_classes is None or test_classes is None:
        return
    train, test = list(train_classes), list(test_classes)
    if train == test:
        return
    missing = [c for c in train if c not in set(test)]
    extra = [c for c in test if c not in set(train)]
    detail = []
    if missing:
        detail.append(f"missing from the test split: {_few(missing)}")
    if extra:
        detail.append(f"not in the training split: {_few(extra)}")
    if not detail:
        detail.append("the same names in another order")
    raise ClassMismatchError(
        f"class folders differ ({where}): {'; '.join(detail)}. Labels are indices into the "
        "training split's class list, so every test class must be one of the training classes "
        "and every training class must be present"
    )


def _few(names, n=10):
    shown = ", ".join(map(str, names[:n]))
    return f"{shown} (+{len(names) - n} more)" if len(names) > n else shown


# ------------------------------------------------------------------------------------------------ #
# Skipped corrupt files
# ------------------------------------------------------------------------------------------------ #

SKIPPED_FILES = "skipped_files.txt"


class SkippedFiles:
    """Names the corrupt samples skipped under DATA_LOADER.SKIP_CORRUPT: the first ``show`` in
    the log, every one (once) in ``OUT_DIR/skipped_files.txt``."""

    def __init__(self, out_dir=None, show=5):
        self.path = os.path.join(out_dir, SKIPPED_FILES) if out_dir else None
        self.show, self.seen = show, set()
        self._logger = logging.getLogger(__name__)

    def add(self, reasons):
        # One line each, whatever bytes a file name holds (a newline, bytes that are not UTF-8)
        new = [one_line(r) for r in reasons]
        new = [r for r in dict.fromkeys(new) if r not in self.seen]
        for reason in new:
            self.seen.add(reason)
            if len(self.seen) <= self.show:
                self._logger.warning(f"skipped a corrupt sample: {reason}")
            if len(self.seen) == self.show + 1 and self.path:
                self._logger.warning(f"more corrupt samples skipped; all are listed in {self.path}")
        if new and self.path:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write("".join(r + "\n" for r in new))
            except OSError as e:
                self._logger.error(describe_write_error(self.path, e))


_SKIPPED = SkippedFiles()


def set_skipped_files(out_dir, show=5):
    """Where this process records skipped samples from now on."""
    global _SKIPPED
    _SKIPPED = SkippedFiles(out_dir, show)
    return _SKIPPED


def record_skipped(num_skipped):
    """Records the reasons a collated batch carries (``pycls.datasets.loader.SkipCount``)."""
    reasons = getattr(num_skipped, "reasons", ())
    if reasons:
        _SKIPPED.add(reasons)


def classes_of(dataset):
    """The class names of a (possibly wrapped, ``.base``) data set, or None when it has none."""
    seen = 0
    while dataset is not None and seen < 8:
        classes = getattr(dataset, "classes", None)
        if classes is not None:
            return list(classes)
        dataset, seen = getattr(dataset, "base", None), seen + 1
    return None
