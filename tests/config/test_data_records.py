"""The DATA_LOADER keys that feed a constructor are generated from the fields of three records
(``LoaderSettings``: the loader's workers, prefetch, corrupt samples and shuffle buffer;
``UrlReadSettings``: how URLs are read; ``ReaderSettings``: what the readers are held to) and
keep the names, defaults, values and bounds the hand-written keys had; what the keys give reaches
the constructors whole."""

import inspect

import pytest

from pycls import config
from pycls.config import data_source
from pycls.config.sections import data
from pycls.core.builders import data_builders
from pycls.datasets.loading.loader import construct_loader
from pycls.datasets.loading.loader_settings import LoaderSettings
from pycls.datasets.transport import url_policy
from tests.helpers import QUICKSTART

# The keys as they were written by hand before the records generated them: name, default, and
# the value table that bounded each
WRITTEN = {
    "DATA_LOADER.NUM_WORKERS": (4, "NON_NEGATIVE"),
    "DATA_LOADER.PIN_MEMORY": (True, None),
    "DATA_LOADER.PERSISTENT_WORKERS": (True, None),
    "DATA_LOADER.PREFETCH_FACTOR": (4, "POSITIVE"),
    "DATA_LOADER.SKIP_CORRUPT": (False, None),
    "DATA_LOADER.SHUFFLE_BUFFER": (8192, "NON_NEGATIVE"),
    "DATA_LOADER.RETRIES": (3, "POSITIVE"),
    "DATA_LOADER.READ_TIMEOUT": (60.0, "POSITIVE"),
    "DATA_LOADER.MIN_READ_RATE_KB": (16.0, "POSITIVE"),
    "DATA_LOADER.READAHEAD_MB": (256, "NON_NEGATIVE"),
    "DATA_LOADER.STORAGE_OPTIONS": ("", None),
    "DATA_LOADER.MAX_IMAGE_PIXELS": (89_478_485, "NON_NEGATIVE"),
    "DATA_LOADER.MAX_DECOMPRESSED_BYTES": (1 << 30, "POSITIVE"),
    "DATA_LOADER.MAX_COMPRESSION_RATIO": (100.0, "NON_NEGATIVE"),
    "DATA_LOADER.INDEX_CACHE": ("", None),
    "DATA_LOADER.VERIFY_SHARDS": ("members", None),
    "DATA_LOADER.IMAGE_PATHS": ("below", None),
    "DATA_LOADER.UNLISTED_SHARDS": ("refuse", None),
}
# The values the hand-written keys took
WRITTEN_CHOICES = {
    "DATA_LOADER.VERIFY_SHARDS": ("members", "headers", "sha256"),
    "DATA_LOADER.IMAGE_PATHS": ("below", "any"),
    "DATA_LOADER.UNLISTED_SHARDS": ("refuse", "skip"),
}


def test_the_generated_keys_are_the_hand_written_ones():
    """Caught: a field renamed (its key with it), a default or a bound changed, a key generated
    that no section took into the tree."""
    defaults = config.get_default_cfg()
    records = (data.LOADER_RECORD, data.URL_READ_RECORD, data.READER_RECORD)
    generated = {k.key for record in records for k in record.keys.values()}
    assert generated == set(WRITTEN)
    for key, (default, table) in WRITTEN.items():
        value = config.get(defaults, key)
        assert value == default and type(value) is type(default), key
        for name in ("POSITIVE", "NON_NEGATIVE"):
            assert (key in getattr(data, name)) == (name == table), (key, name)
        assert data.REFERENCE[key].strip(), key
    assert data.FEATURES["skip corrupt"][0] == "DATA_LOADER.SKIP_CORRUPT"
    for key, values in WRITTEN_CHOICES.items():
        assert data.CHOICES[key] == values, key


def test_what_the_keys_give_reaches_the_constructors():
    """Every LoaderSettings field is a keyword argument of construct_loader, given the key's
    value; every UrlReadSettings field reaches the Access a run reads with. Caught: a field that
    no constructor takes (the builder would fail), a key read into the wrong argument."""
    params = inspect.signature(construct_loader).parameters
    settings = LoaderSettings()
    assert set(settings.kwargs()) <= {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    opts = ["DATA_LOADER.NUM_WORKERS", "0", "DATA_LOADER.PREFETCH_FACTOR", "7",
            "DATA_LOADER.SHUFFLE_BUFFER", "11", "DATA_LOADER.SKIP_CORRUPT", "True",
            "DATA_LOADER.RETRIES", "5", "DATA_LOADER.READ_TIMEOUT", "9.0",
            "DATA_LOADER.MIN_READ_RATE_KB", "2.0", "DATA_LOADER.READAHEAD_MB", "3",
            "DATA_LOADER.STORAGE_OPTIONS", '{"anon": true}']  # fmt: skip
    cfg = config.read_cfg(QUICKSTART, opts)
    got = data_builders.loader_settings(cfg)
    assert (got.num_workers, got.prefetch_factor, got.shuffle_buffer, got.skip_corrupt) == (
        0, 7, 11, True
    )  # fmt: skip
    read = data_builders.reader_settings(
        config.read_cfg(
            QUICKSTART,
            [
                "DATA_LOADER.MAX_IMAGE_PIXELS",
                "5",
                "DATA_LOADER.INDEX_CACHE",
                "/x",
                "DATA_LOADER.UNLISTED_SHARDS",
                "skip",
            ],
        )  # fmt: skip
    )
    assert (read.max_image_pixels, read.index_cache, read.unlisted_shards) == (5, "/x", "skip")
    access = data_source.read_access(cfg)
    assert (access.retries, access.read_timeout, access.readahead_bytes) == (5, 9.0, 3 << 20)
    assert access.min_rate == 2.0 * 1024 and access.storage_options == {"anon": True}


@pytest.mark.parametrize(("key", "value"), [("DATA_LOADER.PREFETCH_FACTOR", "0"),
                                            ("DATA_LOADER.READAHEAD_MB", "-1")])  # fmt: skip
def test_a_generated_key_is_bounded_naming_it(key, value):
    with pytest.raises(config.ConfigError, match=f"^{key}"):
        config.load_cfg(QUICKSTART, [key, value])


def test_read_access_takes_the_record():
    """The transport's policy reads its settings from the record alone (no config)."""
    access = url_policy.read_access(url_policy.UrlReadSettings(retries=2))
    assert access.retries == 2 and access.read_timeout == url_policy.UrlReadSettings.read_timeout
