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

import contextlib
import json
import os
import re
from dataclasses import MISSING, asdict, dataclass, fields, replace

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


def detect_format(path: str, access: remote_files.Access | None = None, listing=None) -> str | None:
    """ "wds" or "parquet" when ``path`` is a pattern, file, folder or URL of such files; None
    when it holds neither (an image folder, CIFAR's pickles). Lists a folder (two levels) unless
    its ``listing`` is given; a URL that cannot be listed raises (DataPathError: not there;
    DataReadError: not reached)."""
    if not path:
        return None
    if is_pattern(path) or format_of_name(path):
        names = [path.split("{")[0] + path.rsplit("}", 1)[-1]] if "{" in path else [path]
        return format_of_name(names[0]) or format_of_name(path.rstrip("*?"))
    if listing is None and not (remote_files.is_url(path) or remote_files.isdir(path)):
        return None
    listing = remote_files.list_files(path, access=access) if listing is None else listing
    found = {format_of_name(f) for f in listing} - {None}
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
                access: remote_files.Access | None = None, listing=None) -> list[str]:  # fmt: skip
    """The files of ``split`` in the ``fmt`` convention that ``path`` names, sorted; raises
    DataSourceError saying what is there when there are none. ``whole``: a folder none of whose
    files is named for a split is all this split (the training split's folder). ``listing``: the
    folder's files, when already listed."""
    suffixes = FORMATS[fmt]
    if is_pattern(path):
        files = expand_pattern(path, access)
    elif format_of_name(path):
        files = [path]
        if not remote_files.is_url(path) and not os.path.isfile(remote_files.local_path(path)):
            raise DataSourceError(f"{printable_path(path)} does not exist")
    else:
        return _folder_split(path, split, fmt, whole, access, listing)
    wrong = [f for f in files if not f.lower().endswith(suffixes)]
    if wrong:
        raise DataSourceError(
            f"{printable_path(wrong[0])} is not a {_NAMES[fmt]} file (DATA_LOADER.BACKEND {fmt})"
        )
    return files


_SPLIT_WORDS = {"train", "training", "val", "valid", "validation", "test", "eval", "dev"}


def _folder_split(path, split, fmt, whole, access=None, listing=None) -> list[str]:
    root = path.rstrip("/")
    if not remote_files.is_url(path) and not os.path.isdir(remote_files.local_path(path)):
        raise DataSourceError(f"{printable_path(path)} does not exist")
    every = remote_files.list_files(root, access=access) if listing is None else listing
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


# ------------------------------------------------------------------------------------------------ #
# What DATA.PATH holds, found once per run (the machine step) and recorded in its config
# ------------------------------------------------------------------------------------------------ #

# The two uses of a split's files: training (TRAIN.SPLIT of DATA.PATH) and evaluation (TEST.SPLIT
# of DATA.TEST_PATH where given, else of DATA.PATH)
ROLES = ("train", "test")


@dataclass(frozen=True)
class DataSource:
    """What DATA.PATH holds: ``holds`` is "wds" or "parquet" (tar or parquet shards, as found
    or as DATA_LOADER.BACKEND says), "image folder" (``train/`` of class folders; ``splits``: its
    sub-folders), "own shards" (BACKEND shards: DATA_LOADER.SHARD_PATH), "folder" or "file"
    (another reader's: CIFAR's pickles), "url" (a URL holding neither format), "missing" (a
    local path that is not there) or "" (no path); how it is reached: "local", "http" or an
    fsspec protocol ("s3", "hf", ...); and whether a local path was ``found`` (a pattern of
    shards whose folder is not there holds "wds", not found).

    Shards (``holds`` wds or parquet) also carry, for training and for evaluation (``ROLES``),
    the files the run reads (``files``), where their ``_info.json`` lies (``info``) or why there
    are none to read (``problems``: the builder refuses the split with it, when it is asked
    for); ``test_path`` is DATA.TEST_PATH, which the evaluation files come from when given, and
    ``test_found`` whether a local one is there. ``record(splits)`` writes it as the text of the
    config key DATA.SOURCE, with the splits it was found for; ``from_record`` reads it back."""

    path: str
    holds: str
    reached: str = "local"
    splits: tuple = ()
    found: bool = True
    test_path: str = ""
    test_found: bool = True
    files: tuple = ()  # ((role, (file, ...)), ...)
    info: tuple = ()  # ((role, its _info.json or ""), ...)
    problems: tuple = ()  # ((role, why its split cannot be read), ...)

    def describe(self) -> str:
        where = "" if self.reached == "local" else f" over {self.reached}"
        return f"{printable_path(self.path)}: {self.holds}{where}" if self.path else "no DATA.PATH"

    def split_files(self, role: str) -> tuple[list[str], str | None]:
        """(the files of the split of ``role``, their _info.json: "" where there is none, None
        where it was not looked for); DataSourceError saying why there are no files."""
        files = dict(self.files)
        if role not in files:
            raise DataSourceError(dict(self.problems).get(role, f"no {role} files were looked for"))
        return list(files[role]), dict(self.info).get(role)

    def root(self, role: str) -> str:
        """The path the files of ``role`` are named below: DATA.TEST_PATH's for evaluation where
        it is given, else DATA.PATH's (a pattern's or a file's folder)."""
        return _base(self.test_path if role == "test" and self.test_path else self.path)

    def record(self, splits: tuple[str, str]) -> str:
        """The text of DATA.SOURCE: this source as JSON, found for ``splits`` (TRAIN.SPLIT,
        TEST.SPLIT); each split's files named below the path they come from, a run of numbered
        names as one ``NAME-{000000..001023}.tar``."""
        kept = {k: v for k, v in asdict(self).items() if v != _DEFAULTS.get(k)}
        kept["files"] = {r: _compact(self.root(r), list(fs)) for r, fs in self.files}
        kept.update(info=dict(self.info), problems=dict(self.problems), found_for=list(splits))
        kept = {k: v for k, v in kept.items() if v not in ({}, [], ())}
        return json.dumps({"path": self.path, "holds": self.holds, **kept}, separators=(",", ":"))

    @classmethod
    def from_record(cls, text: str, path: str, test_path: str, backend: str, splits: tuple):
        """The source DATA.SOURCE records, when it was found for this ``path`` (DATA.PATH, or
        DATA_LOADER.SHARD_PATH under BACKEND shards), ``test_path``, ``backend`` (as written or
        as found) and ``splits`` (TRAIN.SPLIT, TEST.SPLIT: both count for shards, the training
        split for the rest); None when it was not (the config changed since: look again)."""
        saved = _saved(text)
        if saved is None or saved.get("path") != path or saved.get("test_path", "") != test_path:
            return None
        found_for = tuple(saved.get("found_for", ()))
        plain = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                 if k in _PLAIN_FIELDS}  # fmt: skip
        source = cls(**plain)
        sharded = source.holds in FORMATS
        same = found_for == tuple(splits) if sharded else found_for[:1] == tuple(splits)[:1]
        if not same or backend not in ("torchvision", "shards", source.holds):
            return None
        files = saved.get("files", {})
        return replace(
            source,
            files=tuple((r, tuple(_expand(source.root(r), names))) for r, names in files.items()),
            info=tuple(saved.get("info", {}).items()),
            problems=tuple(saved.get("problems", {}).items()),
        )


def reached(path: str) -> str:
    """How a path is reached: "local", "http" (http and https) or the URL's protocol."""
    if not remote_files.is_url(path):
        return "local"
    return "http" if remote_files.is_http(path) else path.split("://", 1)[0]


def missing_part(path: str) -> str | None:
    """The local path (for a pattern: its folder) that is not there, or None."""
    local = remote_files.local_path(path)
    if is_pattern(local):
        fixed = local.split("{", 1)[0]
        fixed = fixed[: min((fixed.find(c) for c in "*?[" if c in fixed), default=len(fixed))]
        folder = os.path.dirname(fixed) or "."
        return None if os.path.isdir(folder) else folder
    return None if os.path.exists(local) else local


def find_source(path: str, backend: str, splits: tuple[str, str], test_path: str = "",
                access: remote_files.Access | None = None, defer: bool = True):  # fmt: skip
    """What ``path`` (DATA.PATH) holds, looked at once (``backend``: DATA_LOADER.BACKEND,
    ``splits``: TRAIN.SPLIT and TEST.SPLIT, ``test_path``: DATA.TEST_PATH): a local path is
    stat'ed (a folder's training split scanned for class folders); a folder or URL read with
    BACKEND torchvision is listed (two levels) for tar or parquet files, once, and the files of
    each split are picked from that listing. A URL that cannot be listed raises (DataPathError:
    not there; DataReadError: not reached), as do a folder holding both formats and a pattern
    naming a file that is not there (DataSourceError). A split's files that cannot be read (the
    machine's failure) are left to be looked for where they are read (``defer``), which then
    raises; so is an _info.json that cannot be asked for. Returns the DataSource."""
    fmt = backend if backend != "torchvision" else None
    listing = None
    if fmt is None and not is_pattern(path) and not format_of_name(path):
        folder = remote_files.is_url(path) or remote_files.isdir(path)
        listing = remote_files.list_files(path, access=access) if folder else None
    if fmt is None:
        fmt = detect_format(path, access, listing or [])
    source = _what_is_there(path, fmt, splits[0])
    test_found = not test_path or remote_files.is_url(test_path) or not missing_part(test_path)
    source = replace(source, test_path=test_path, test_found=test_found)
    if fmt not in FORMATS:
        return source
    return _with_split_files(source, splits, access, listing, defer)


def _what_is_there(path: str, fmt: str | None, train_split: str) -> DataSource:
    how = reached(path)
    if how != "local":
        return DataSource(path, fmt or "url", how)
    if missing_part(path) is not None:  # shards it names (a pattern) are still shards, unfound
        return DataSource(path, fmt or "missing", found=False)
    local = remote_files.local_path(path)
    if fmt:
        return DataSource(path, fmt)
    if not os.path.isdir(local):
        return DataSource(path, "file")
    found = tuple(sorted(e.name for e in os.scandir(local) if e.is_dir()))
    train = os.path.join(local, train_split)
    image_folder = train_split in found and any(e.is_dir() for e in os.scandir(train))
    return DataSource(path, "image folder" if image_folder else "folder", splits=found)


def _with_split_files(source: DataSource, splits, access, listing, defer) -> DataSource:
    """``source`` with the files of each split the run reads (or why there are none); a split
    whose folder could not be read (the machine's failure) is left to be looked for where it is
    read, which says so."""
    files, info, problems = {}, {}, {}
    for role, split in zip(ROLES, splits):
        own = role == "test" and bool(source.test_path)
        path, key = (source.test_path, "DATA.TEST_PATH") if own else (source.path, "DATA.PATH")
        if role == "test" and not own and (is_pattern(path) or format_of_name(path)):
            problems[role] = (
                f"DATA.TEST_PATH: DATA.PATH {path} names the training split's shards only; give "
                f"the evaluation split's ({split}) in DATA.TEST_PATH"
            )
            continue
        try:
            found = split_files(path, split, source.holds, role == "train" or own, access,
                                None if own else listing)  # fmt: skip
        except (DataSourceError, remote_files.DataPathError) as e:
            problems[role] = f"{key}: {e}"
            continue
        except remote_files.DataReadError:
            if not defer:
                raise
            continue
        files[role] = tuple(found)
        with contextlib.suppress(remote_files.DataReadError):  # asked again where it is read
            info[role] = info_file(found, path, access) or ""
    return replace(source, files=tuple(files.items()), info=tuple(info.items()),
                   problems=tuple(problems.items()))  # fmt: skip


def _saved(text: str) -> dict | None:
    """DATA.SOURCE's text as a dict of DataSource's fields (None: empty, or not such a record)."""
    try:
        saved = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(saved, dict) or not {"path", "holds"} <= set(saved):
        return None
    known = _PLAIN_FIELDS | {"files", "info", "problems", "found_for"}
    return saved if set(saved) <= known else None


_DEFAULTS = {f.name: f.default for f in fields(DataSource) if f.default is not MISSING}
# The fields a record holds as they are (the rest: files, info, problems, as mappings)
_PLAIN_FIELDS = {f.name for f in fields(DataSource)} - {"files", "info", "problems"}


def _base(path: str) -> str:
    """The folder the files of ``path`` lie below: itself, or the fixed folder of a pattern or a
    file."""
    if not (is_pattern(path) or format_of_name(path)):
        return path.rstrip("/")
    fixed = path.split("{", 1)[0]
    fixed = fixed[: min((fixed.find(c) for c in "*?[" if c in fixed), default=len(fixed))]
    return fixed.rsplit("/", 1)[0] if "/" in fixed else ""


# A name ending in a number: its run of consecutive numbers of one width is written as one entry
_NUMBERED = re.compile(r"(.*?)(\d+)(\D*)")
_RANGE = re.compile(r"(.*)\{(\d+)\.\.(\d+)\}(.*)")


def _compact(root: str, files: list[str]) -> list:
    """``files`` as names below ``root``, each run of three or more numbered names as one
    ``NAME{FIRST..LAST}SUFFIX``; a file elsewhere, or whose name holds a brace, as a one-item
    list of its whole name."""
    out, run = [], []

    def flush():
        if len(run) >= 3:
            head, first, tail = _NUMBERED.fullmatch(run[0]).groups()
            out.append(f"{head}{{{first}..{_NUMBERED.fullmatch(run[-1])[2]}}}{tail}")
        else:
            out.extend(run)
        run.clear()

    prefix = root + "/" if root else ""
    for path in files:
        name = path[len(prefix) :]
        if not path.startswith(prefix) or "{" in name or "}" in name:
            flush()
            out.append([path])
            continue
        if run and not _follows(run[-1], name):
            flush()
        run.append(name)
    flush()
    return out


def _follows(before: str, name: str) -> bool:
    """Whether ``name`` is the next of a run of numbered names after ``before``."""
    a, b = _NUMBERED.fullmatch(before), _NUMBERED.fullmatch(name)
    same = bool(a and b) and (a[1], a[3], len(a[2])) == (b[1], b[3], len(b[2]))
    return same and int(b[2]) == int(a[2]) + 1


def _expand(root: str, entries: list) -> list[str]:
    """The files ``_compact`` wrote as ``entries``, named as they were."""
    prefix, paths = root + "/" if root else "", []
    for entry in entries:
        if isinstance(entry, list):
            paths.append(entry[0])
        elif (m := _RANGE.fullmatch(entry)) is not None:
            head, first, last, tail = m.groups()
            width = len(first)
            paths += [
                f"{prefix}{head}{k:0{width}d}{tail}" for k in range(int(first), int(last) + 1)
            ]
        else:
            paths.append(prefix + entry)
    return paths
