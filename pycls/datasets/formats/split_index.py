"""What a folder of tar or parquet shards holds is what its index says: ``_info.json`` (timm's
record of each split's files and sample counts; pycls's writers add the classes), kept true by
the writers and trusted by the reader.

- The writers (``pycls.datasets.formats.tar_writer`` and ``parquet_writer``: ``pycls prepare
  --format wds / parquet``) refuse to write a split beside files of that split they did not name
  (``earlier_files``), empty the split's list in the index before writing over a file it lists
  (``unrecord_if_replaced``: a preparation killed part-way leaves files the index does not list,
  which the reader refuses, never the old record over a mix of old and new files), record the split
  once its files are whole (``record_split``), and only then remove their own earlier files of the
  split that the new set does not hold (``remove_stale``).
- The reader trains only the files the index lists when it lists any (``unlisted_files`` names
  the others; DATA_LOADER.UNLISTED_SHARDS says whether they are refused or skipped).

Plain Python, no torch.
"""

import json
import logging
import re
from pathlib import Path

from pycls.atomic_files import write_text_atomic
from pycls.datasets.formats import data_sources
from pycls.errors import ConfigError, printable_path

logger = logging.getLogger(__name__)

INFO_JSON = "_info.json"


def listed_names(info: dict) -> set[str] | None:
    """The file names (without folders) that an ``_info.json`` lists under its splits (each
    split's ``filenames``), or None when it has no such lists (a record of classes only)."""
    splits = info.get("splits") if isinstance(info.get("splits"), dict) else {}
    lists = [s.get("filenames") for s in splits.values() if isinstance(s, dict)]
    lists = [names for names in lists if isinstance(names, list)]
    if not lists:
        return None
    return {n.rsplit("/", 1)[-1] for names in lists for n in names if isinstance(n, str)}


def unlisted_files(files: list[str], info: dict) -> list[str]:
    """The files of ``files`` that ``info`` (the folder's ``_info.json``) lists under no split,
    where it lists a split's files: what the folder holds beside what was prepared (a file left
    by an earlier preparation, or written by one that did not finish). An index that lists only
    files of another format (tars, where these are parquet files) says nothing of these."""
    listed = listed_names(info)
    kinds = {_suffix(f) for f in files}
    if listed is None or (listed and not any(_suffix(n) in kinds for n in listed)):
        return []
    return [f for f in files if f.rsplit("/", 1)[-1] not in listed]


def listed_only(files: list[str], info: dict, where: str | None, key: str, unlisted="refuse"):
    """The files of the split that the folder's _info.json (``info``, read from ``where``)
    lists (all of them where it lists none); one it does not list is refused naming it (a
    ConfigError naming ``key``: DATA.PATH or DATA.TEST_PATH), or, under ``unlisted`` "skip"
    (DATA_LOADER.UNLISTED_SHARDS), left out and named in the log."""
    left = unlisted_files(files, info)
    if not left:
        return files
    more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
    what = (f"{printable_path(left[0])}{more} is not listed in {printable_path(where)}, which "
            "records the files each split holds: left by an earlier preparation into the same "
            "folder, or by one that did not finish")  # fmt: skip
    if unlisted == "refuse" or len(left) == len(files):
        raise ConfigError(
            f"{key}: {what}. Prepare the split again, remove the file, or set "
            "DATA_LOADER.UNLISTED_SHARDS skip to train only the listed ones"
        )
    logger.warning(f"{what}: skipped (DATA_LOADER.UNLISTED_SHARDS skip)")
    return [f for f in files if f not in left]


def _suffix(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def read_index(path: Path) -> dict:
    """A local ``_info.json`` as a dict ({} when absent or not a JSON object: written anew)."""
    try:
        info = json.loads(path.read_text()) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def earlier_files(root: Path, split: str, suffix: str, own: str) -> list[Path]:
    """The files of ``split`` already under ``root`` that the writer names (``own``: a regular
    expression of the path below ``root``), to be written over or removed. Any other file that
    the reader would take as the split's (named for it, two levels deep, as it lists a folder) is
    refused with a ValueError naming it: the new files beside it would be trained with it."""
    found = [p for p in [*root.glob(f"*{suffix}"), *root.glob(f"*/*{suffix}")] if p.is_file()]
    earlier = []
    for path in sorted(found):
        below = path.relative_to(root).as_posix()
        if below.startswith(".") or not data_sources.names_split(below, split):
            continue
        if not re.fullmatch(own, below):
            raise ValueError(
                f"{printable_path(path)} of split {split!r} is already in {printable_path(root)} "
                "and was not written by pycls prepare: a reader would train it beside the new "
                "files. Remove it, or write elsewhere (--out)"
            )
        earlier.append(path)
    return earlier


def _write(path: Path, info: dict) -> None:
    write_text_atomic(path, json.dumps(info, indent=1))


def unrecord_if_replaced(path: Path, split: str, names: list[str]) -> None:
    """Empties the list of ``split``'s files in the index at ``path`` when the new files
    ``names`` would write over a file it lists for the split."""
    info = read_index(path)
    splits = info.get("splits") if isinstance(info.get("splits"), dict) else {}
    recorded = splits.get(split)
    listed = recorded.get("filenames") if isinstance(recorded, dict) else None
    if set(names) & {str(n).rsplit("/", 1)[-1] for n in listed or []}:
        splits[split] = {"name": split, "num_samples": 0, "filenames": [], "shard_lengths": []}
        _write(path, info)


def record_split(path: Path, name: str, split: str, files, lengths, classes, num_classes) -> None:
    """Adds (or replaces) ``split`` in the index at ``path`` (timm's format: ``name``, each
    split's ``filenames`` and ``shard_lengths``; with the classes)."""
    info = read_index(path)
    info.setdefault("name", name)
    if not isinstance(info.get("splits"), dict):
        info["splits"] = {}
    info["splits"][split] = {
        "name": split,
        "num_samples": int(sum(lengths)),
        "filenames": list(files),
        "shard_lengths": [int(n) for n in lengths],
    }
    info["num_classes"], info["classes"] = num_classes, classes
    _write(path, info)


def remove_stale(earlier: list[Path], names: list[str]) -> None:
    """Once the new set is recorded: the earlier files of the split that it does not hold."""
    for path in earlier:
        if path.name not in names:
            path.unlink(missing_ok=True)
