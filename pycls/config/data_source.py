"""What DATA.PATH holds and how it is reached: the machine step's first answer
(``pycls.config.machine.resolve_for_machine`` takes it, and records it in the config as
DATA.SOURCE), found once per run without torch, so that a path that is not there is answered in
one line before the training code loads.

``find_data_source(cfg)`` asks the data once (``pycls.datasets.formats.data_sources.find_source``:
a local path stat'ed, a folder or URL listed once for tar or parquet files, the files of each
split picked from that listing), or takes what DATA.SOURCE records when the config is the one it
was found for (a run started from its own config.yaml lists nothing). ``require_readable``
refuses, for the modes that read data, a DATA.PATH (or DATA.TEST_PATH, DATA_LOADER.SHARD_PATH)
that the run would read and that is not there: a ConfigError naming the key (exit status 2); a
server that cannot be reached is the machine's failure (1). The data builders read the recorded
source (``recorded_source``) and list nothing again. Plain Python, no torch.
"""

import os

from pycls.config.sections.data import URL_READ_RECORD
from pycls.datasets.formats import data_sources
from pycls.datasets.formats.data_sources import DataSource
from pycls.datasets.transport import remote_files, url_policy
from pycls.errors import ConfigError, printable_path, require

__all__ = ["DataSource", "find_data_source", "read_access", "recorded_source", "require_readable"]

# The data sets that read DATA.PATH (digits is bundled; synthetic is drawn)
_READ_FROM_PATH = ("imagefolder", "cifar10", "cifar100")
# The bundled data set, which reads no folder: a DATA.PATH given with it would be silently ignored
# (synthetic, which reads none either, is chosen to time a model without data, DATA.PATH or not)
_NO_FOLDER = ("digits",)
# What DATA.PATH may hold whatever data set the config names (the machine step points the data
# keys at it)
_FOR_ANY_DATA_SET = ("wds", "parquet", "image folder")


def read_access(c):
    """How DATA.PATH's URLs are read (``url_policy.read_access`` of the DATA_LOADER keys generated
    from ``UrlReadSettings``), asked where the data is read."""
    return url_policy.read_access(url_policy.UrlReadSettings(**URL_READ_RECORD.arguments_of(c)))


def recorded_source(c) -> DataSource | None:
    """The source DATA.SOURCE records, when it was found for this config's data keys (else
    None: the config changed since, or no machine step looked)."""
    dl = c.DATA_LOADER
    path = dl.SHARD_PATH if dl.BACKEND == "shards" else c.DATA.PATH
    splits = (c.TRAIN.SPLIT, c.TEST.SPLIT)
    return DataSource.from_record(c.DATA.SOURCE, path, c.DATA.TEST_PATH, dl.BACKEND, splits)


def find_data_source(c, again=False) -> DataSource:
    """What DATA.PATH holds on this machine (see the module's docstring): as DATA.SOURCE records
    it, unless ``again`` (a split whose folder could not be read then). A path that is not there
    is "missing" (``require_readable`` refuses it where it is read); one that no data set of the
    config would read is refused."""
    source = (None if again else recorded_source(c)) or _look(c, defer=not again)
    _refuse_unread(c, source.path, source.holds)
    return source


def _look(c, defer=True):
    dl = c.DATA_LOADER
    if dl.BACKEND == "shards":
        folder = dl.SHARD_PATH
        return DataSource(folder, "own shards", found=not folder or os.path.isdir(folder))
    if not c.DATA.PATH:
        return DataSource("", "")
    splits = (c.TRAIN.SPLIT, c.TEST.SPLIT)
    try:
        return data_sources.find_source(c.DATA.PATH, dl.BACKEND, splits, c.DATA.TEST_PATH,
                                        read_access(c), defer)  # fmt: skip
    except (data_sources.DataSourceError, remote_files.DataPathError) as e:
        raise ConfigError(f"DATA.PATH: {e}") from None


def require_readable(c, source: DataSource) -> None:
    """Refuses, naming the key, a data path that the run would read and that is not there:
    DATA.PATH (``source``) when a data set of the config reads it or it names shards,
    DATA.TEST_PATH, DATA_LOADER.SHARD_PATH. (Modes that read no data ask nothing.)"""
    if not source.test_found:
        raise ConfigError(f"DATA.TEST_PATH: {_not_there(c.DATA.TEST_PATH)}")
    if source.found:
        return
    if c.DATA_LOADER.BACKEND == "shards":
        require(False, "DATA_LOADER.SHARD_PATH",
                f"{printable_path(source.path)} is not a folder of prepared shards (it does not "
                "exist)")  # fmt: skip
    reads = {c.TRAIN.DATASET, c.TEST.DATASET} & set(_READ_FROM_PATH)
    if source.holds in ("wds", "parquet") or reads:
        raise ConfigError(f"DATA.PATH: {_not_there(c.DATA.PATH)}")


def _refuse_unread(c, path, holds):
    """A DATA.PATH that is no image folder (nor shards) given to a config whose data sets are
    the bundled digits is refused: it would train on them as if DATA.PATH were not there
    (synthetic data reads none)."""
    if not path or c.DATA_LOADER.BACKEND != "torchvision" or holds in _FOR_ANY_DATA_SET:
        return
    if not {c.TRAIN.DATASET, c.TEST.DATASET} <= set(_NO_FOLDER):
        return  # a data set that reads DATA.PATH says itself what is wrong with it
    what = {"missing": "does not exist", "url": "holds no WebDataset .tar or .parquet files"}
    require(
        False,
        "DATA.PATH",
        f"{printable_path(path)} {what.get(holds, 'is not an image folder')} (train/ and val/ of "
        f"class folders), and TRAIN.DATASET {c.TRAIN.DATASET} reads no folder: it would train on "
        f"{c.TRAIN.DATASET} as if DATA.PATH were not given; give an image folder, or set "
        "TRAIN.DATASET / TEST.DATASET",
    )


def _not_there(path):
    folder = data_sources.missing_part(path)
    gone = f" (no folder {printable_path(folder)})" if folder != path else ""
    return f"{printable_path(path)} does not exist{gone}"
