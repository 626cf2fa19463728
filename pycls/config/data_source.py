"""What DATA.PATH holds and how it is reached: the machine step's first answer
(``pycls.config.machine.resolve_for_machine`` takes it), found once per run without torch, so that
a path that is not there is answered in one line before the training code loads.

``find_data_source(cfg)`` looks once: a local path is stat'ed (a folder's ``train/`` scanned for
class folders), a folder or URL named with BACKEND torchvision is listed (two levels) for tar or
parquet files. ``require_readable`` refuses, for the modes that read data, a DATA.PATH (or
DATA.TEST_PATH, DATA_LOADER.SHARD_PATH) that the run would read and that is not there: a
ConfigError naming the key (exit status 2); a server that cannot be reached is the machine's
failure (1). Plain Python, no torch.
"""

import os
from dataclasses import dataclass

from pycls.config.sections.data import url_access
from pycls.datasets.formats import data_sources
from pycls.datasets.transport import remote_files
from pycls.errors import ConfigError, printable_path, require

# The data sets that read DATA.PATH (digits is bundled; synthetic is drawn)
_READ_FROM_PATH = ("imagefolder", "cifar10", "cifar100")
# The bundled data set, which reads no folder: a DATA.PATH given with it would be silently ignored
# (synthetic, which reads none either, is chosen to time a model without data, DATA.PATH or not)
_NO_FOLDER = ("digits",)


@dataclass(frozen=True)
class DataSource:
    """What DATA.PATH holds: ``holds`` is "wds" or "parquet" (tar or parquet shards, as found
    or as DATA_LOADER.BACKEND says), "image folder" (``train/`` of class folders; ``splits``: its
    sub-folders), "own shards" (BACKEND shards: DATA_LOADER.SHARD_PATH), "folder" or "file"
    (another reader's: CIFAR's pickles), "url" (a URL holding neither format), "missing" (a
    local path that is not there) or "" (no path); how it is reached: "local", "http" or an
    fsspec protocol ("s3", "hf", ...); and whether a local path was ``found`` (a pattern of
    shards whose folder is not there holds "wds", not found)."""

    path: str
    holds: str
    reached: str = "local"
    splits: tuple = ()
    found: bool = True

    def describe(self) -> str:
        where = "" if self.reached == "local" else f" over {self.reached}"
        return f"{printable_path(self.path)}: {self.holds}{where}" if self.path else "no DATA.PATH"


def reached(path: str) -> str:
    """How a path is reached: "local", "http" (http and https) or the URL's protocol."""
    if not remote_files.is_url(path):
        return "local"
    return "http" if remote_files.is_http(path) else path.split("://", 1)[0]


def find_data_source(c) -> DataSource:
    """What DATA.PATH holds on this machine (see the module's docstring). A path that is not
    there is "missing" (``require_readable`` refuses it where it is read); one that no data set
    of the config would read is refused."""
    if c.DATA_LOADER.BACKEND == "shards":
        folder = c.DATA_LOADER.SHARD_PATH
        return DataSource(folder, "own shards", found=not folder or os.path.isdir(folder))
    if not c.DATA.PATH:
        return DataSource("", "")
    source = _look(c, c.DATA.PATH)
    _refuse_unread(c, source)
    return source


def require_readable(c, source: DataSource) -> None:
    """Refuses, naming the key, a data path that the run would read and that is not there:
    DATA.PATH (``source``) when a data set of the config reads it or it names shards,
    DATA.TEST_PATH, DATA_LOADER.SHARD_PATH. (Modes that read no data ask nothing.)"""
    path = c.DATA.TEST_PATH
    if path and not remote_files.is_url(path) and _missing(remote_files.local_path(path)):
        raise ConfigError(f"DATA.TEST_PATH: {_not_there(path)}")
    if source.found:
        return
    if c.DATA_LOADER.BACKEND == "shards":
        require(False, "DATA_LOADER.SHARD_PATH",
                f"{printable_path(source.path)} is not a folder of prepared shards (it does not "
                "exist)")  # fmt: skip
    reads = {c.TRAIN.DATASET, c.TEST.DATASET} & set(_READ_FROM_PATH)
    if source.holds in ("wds", "parquet") or reads:
        raise ConfigError(f"DATA.PATH: {_not_there(source.path)}")


def _look(c, path):
    how = reached(path)
    fmt = c.DATA_LOADER.BACKEND if c.DATA_LOADER.BACKEND != "torchvision" else _format_in(c)
    if how != "local":
        return DataSource(path, fmt or "url", how)
    local = remote_files.local_path(path)
    if _missing(local) is not None:  # shards it names (a pattern) are still shards, unfound
        return DataSource(path, fmt or "missing", found=False)
    if fmt:
        return DataSource(path, fmt)
    if not os.path.isdir(local):
        return DataSource(path, "file")
    found = tuple(sorted(e.name for e in os.scandir(local) if e.is_dir()))
    train = os.path.join(local, c.TRAIN.SPLIT)
    image_folder = c.TRAIN.SPLIT in found and any(e.is_dir() for e in os.scandir(train))
    return DataSource(path, "image folder" if image_folder else "folder", splits=found)


def _format_in(c):
    """ "wds" or "parquet" where DATA.PATH names or holds such files (BACKEND torchvision)."""
    try:
        return data_sources.detect_format(c.DATA.PATH, url_access(c))
    except (data_sources.DataSourceError, remote_files.DataPathError) as e:
        raise ConfigError(f"DATA.PATH: {e}") from None


def _missing(local):
    """The local path (for a pattern: its folder) that is not there, or None."""
    if data_sources.is_pattern(local):
        fixed = local.split("{", 1)[0]
        fixed = fixed[: min((fixed.find(c) for c in "*?[" if c in fixed), default=len(fixed))]
        folder = os.path.dirname(fixed) or "."
        return None if os.path.isdir(folder) else folder
    return None if os.path.exists(local) else local


def _refuse_unread(c, source):
    """A DATA.PATH that is no image folder (nor shards) given to a config whose data sets are
    the bundled digits is refused: it would train on them as if DATA.PATH were not there
    (synthetic data reads none)."""
    path, torchvision = printable_path(source.path), c.DATA_LOADER.BACKEND == "torchvision"
    if not torchvision or source.holds in ("wds", "parquet", "image folder"):
        return
    if not {c.TRAIN.DATASET, c.TEST.DATASET} <= set(_NO_FOLDER):
        return  # a data set that reads DATA.PATH says itself what is wrong with it
    what = {"missing": "does not exist", "url": "holds no WebDataset .tar or .parquet files"}
    require(
        False,
        "DATA.PATH",
        f"{path} {what.get(source.holds, 'is not an image folder')} (train/ and val/ of class "
        f"folders), and TRAIN.DATASET {c.TRAIN.DATASET} reads no folder: it would train on "
        f"{c.TRAIN.DATASET} as if DATA.PATH were not given; give an image folder, or set "
        "TRAIN.DATASET / TEST.DATASET",
    )


def _not_there(path):
    folder = _missing(remote_files.local_path(path))
    gone = f" (no folder {printable_path(folder)})" if folder != path else ""
    return f"{printable_path(path)} does not exist{gone}"
