"""Which files hold a split, and in which convention, from the one path the user gives
(DATA.PATH): a WebDataset shard pattern, a folder or URL of ``.tar`` or ``.parquet`` files, or a
Hugging Face repository (``hf://datasets/ORG/NAME``).

- A pattern (``/data/imagenet-train-{000000..001281}.tar``, brace ranges as WebDataset and timm
  write them, or a glob ``*.tar``) or a single file names one split's shards.
- A folder (local or URL) holds every split: the files of split S are those under a sub-folder
  named S, or whose name has S as a word (``train-00000-of-00146.parquet``,
  ``imagenet1k-validation-0001.tar``); "val" also finds "validation" and "valid", and a split
  that is not there at all falls back to its sibling (val <-> test), as the other readers do.
"""

import os
import re

from pycls.datasets.transport import remote_files
from pycls.errors import UserError, printable_path

FORMATS = {"wds": (".tar",), "parquet": (".parquet",)}
_NAMES = {"wds": "WebDataset .tar", "parquet": ".parquet"}
_SYNONYMS = {"val": ("val", "validation", "valid"), "validation": ("validation", "val", "valid")}
_SIBLING = {"val": "test", "validation": "test", "test": "val"}


class DataSourceError(UserError, ValueError):
    """DATA.PATH names nothing this reader can use; the message says what was found."""


def is_pattern(path: str) -> bool:
    return bool(re.search(r"\{[^}]*(\.\.|,)[^}]*\}", path)) or any(c in path for c in "*?[")


def expand_pattern(path: str, access: remote_files.Access | None = None) -> list[str]:
    """The files of a brace pattern (expanded, as WebDataset does) or a glob (listed). A local
    file a brace pattern names that is not there is a DataSourceError naming it (a URL's is
    found missing when it is read)."""
    if "{" in path:
        import braceexpand  # optional: WebDataset's own dependency, for shard patterns

        names = list(braceexpand.braceexpand(path))
        files = [n for name in names for n in (_glob(name, access) if _has_glob(name) else [name])]
        missing = [f for f in files if not remote_files.is_url(f) and not os.path.isfile(
            remote_files.local_path(f))]  # fmt: skip
        if missing:
            more = f" (and {len(missing) - 1} more of the {len(files)})" if len(missing) > 1 else ""
            raise DataSourceError(
                f"{printable_path(missing[0])}{more}, named by the pattern "
                f"{printable_path(path)}, does not exist"
            )
        return files
    return _glob(path, access)


def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _glob(pattern: str, access: remote_files.Access | None = None) -> list[str]:
    files = remote_files.glob_files(pattern, access)
    if not files:
        raise DataSourceError(f"no file matches {printable_path(pattern)}")
    return files


def format_of_name(name: str) -> str | None:
    for fmt, suffixes in FORMATS.items():
        if name.lower().endswith(suffixes):
            return fmt
    return None


def detect_format(path: str, access: remote_files.Access | None = None) -> str | None:
    """ "wds" or "parquet" when ``path`` is a pattern, file, folder or URL of such files; None
    when it holds neither (an image folder, CIFAR's pickles). Lists a folder (two levels); a
    URL that cannot be listed raises (DataPathError: not there; DataReadError: not reached)."""
    if not path:
        return None
    if is_pattern(path) or format_of_name(path):
        names = [path.split("{")[0] + path.rsplit("}", 1)[-1]] if "{" in path else [path]
        return format_of_name(names[0]) or format_of_name(path.rstrip("*?"))
    if not (remote_files.is_url(path) or remote_files.isdir(path)):
        return None
    found = {format_of_name(f) for f in remote_files.list_files(path, access=access)} - {None}
    if len(found) > 1:
        raise DataSourceError(
            f"{printable_path(path)} holds both .tar and .parquet files: set "
            "DATA_LOADER.BACKEND wds or parquet to say which to read"
        )
    return found.pop() if found else None


def _words(relative: str) -> set[str]:
    return set(re.split(r"[-_./\\]", relative.lower()))


def names_split(relative: str, split: str) -> bool:
    """Whether a file's path below the folder names ``split`` (or a synonym: val, validation,
    valid), as the folder reader picks a split's files."""
    return bool(_words(relative) & set(_SYNONYMS.get(split, (split,))))


def split_files(path: str, split: str, fmt: str, whole: bool = False,
                access: remote_files.Access | None = None) -> list[str]:  # fmt: skip
    """The files of ``split`` in the ``fmt`` convention that ``path`` names, sorted; raises
    DataSourceError saying what is there when there are none. ``whole``: a folder none of whose
    files is named for a split is all this split (the training split's folder)."""
    suffixes = FORMATS[fmt]
    if is_pattern(path):
        files = expand_pattern(path, access)
    elif format_of_name(path):
        files = [path]
        if not remote_files.is_url(path) and not os.path.isfile(remote_files.local_path(path)):
            raise DataSourceError(f"{printable_path(path)} does not exist")
    else:
        return _folder_split(path, split, fmt, whole, access)
    wrong = [f for f in files if not f.lower().endswith(suffixes)]
    if wrong:
        raise DataSourceError(
            f"{printable_path(wrong[0])} is not a {_NAMES[fmt]} file (DATA_LOADER.BACKEND {fmt})"
        )
    return files


_SPLIT_WORDS = {"train", "training", "val", "valid", "validation", "test", "eval", "dev"}


def _folder_split(path: str, split: str, fmt: str, whole: bool, access=None) -> list[str]:
    root = path.rstrip("/")
    if not remote_files.is_url(path) and not os.path.isdir(remote_files.local_path(path)):
        raise DataSourceError(f"{printable_path(path)} does not exist")
    every = remote_files.list_files(root, access=access)
    files = [f for f in every if f.lower().endswith(FORMATS[fmt])]
    if not files:
        raise DataSourceError(f"no {_NAMES[fmt]} files in {printable_path(path)}")
    if whole and not any(_words(f[len(root) :]) & (_SPLIT_WORDS | {split}) for f in files):
        return files
    for name in (split, _SIBLING.get(split)):
        if name is None:
            continue
        wanted = set(_SYNONYMS.get(name, (name,)))
        mine = [f for f in files if _words(f[len(root) :]) & wanted]
        if mine:
            return mine
    shown = sorted({f[len(root) :].lstrip("/") for f in files})[:4]
    raise DataSourceError(
        f"no {_NAMES[fmt]} file of split {split!r} in {printable_path(path)} (a sub-folder "
        f"{split}/ or a file named with {split!r}); found {shown}"
        + (" ..." if len(files) > 4 else "")
    )


def info_file(files: list[str], path: str, access: remote_files.Access | None = None) -> str | None:
    """The dataset's ``_info.json`` (timm's and this reader's record of splits and classes):
    beside the shards, or in the folder ``path``."""
    candidates = []
    if not is_pattern(path) and not format_of_name(path):
        candidates.append(path.rstrip("/") + "/_info.json")
    if files:
        candidates.append(files[0].rsplit("/", 1)[0] + "/_info.json")
    for candidate in dict.fromkeys(candidates):
        try:
            remote_files.file_size(candidate, 1, access)
        except remote_files.DataPathError:
            continue
        return candidate
    return None
