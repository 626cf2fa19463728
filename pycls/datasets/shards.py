"""Re-export shim: ``pycls.datasets.shards`` held both the prepared shards' writer and their reader;
the format and the reader now live in ``pycls.datasets.formats.prepared_shards``, the writer with
every other shard writer in ``pycls.datasets.formats.shard_writers``. This module re-exports their
public names so that ``from pycls.datasets.shards import ShardDataset, prepare_split`` keeps
working."""

from pycls.datasets.formats.prepared_shards import (
    BAD_IMAGES,
    FORMAT_VERSION,
    FORMATS,
    INDEX_JSON,
    INDEX_NPZ,
    MANIFEST,
    ShardDataset,
    verify_split,
)
from pycls.datasets.formats.shard_writers import (
    PrepareResult,
    ShardWriteError,
    die_with_parent,
    prepare_split,
    resize_center_square,
    write_shard,
)

__all__ = [
    "BAD_IMAGES",
    "FORMATS",
    "FORMAT_VERSION",
    "INDEX_JSON",
    "INDEX_NPZ",
    "MANIFEST",
    "PrepareResult",
    "ShardDataset",
    "ShardWriteError",
    "die_with_parent",
    "prepare_split",
    "resize_center_square",
    "verify_split",
    "write_shard",
]
