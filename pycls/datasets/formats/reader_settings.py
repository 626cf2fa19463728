"""What the readers of a run's data are held to: the bounds of an image and of a parquet file,
where the tar shards' indexes are kept and how the shards are held to them, where a parquet row's
image may lie, and what becomes of a shard its folder's index does not list; each declared once
(``pycls.options``) with its default, its meaning and its values. The config's DATA_LOADER keys of
these settings are generated from the fields (``pycls.config.sections.data``), and the readers
own their values here (``VERIFY_MODES``, ``IMAGE_PATH_RULES``, ``UNLISTED_RULES``). Plain Python,
no torch: the config reads the declarations.
"""

from dataclasses import dataclass

from pycls.options import option

# How a tar shard is checked against what was indexed (``verify_shards``)
VERIFY_MODES = ("members", "headers", "sha256")
# Where a local parquet row's image may lie (``image_paths``)
IMAGE_PATH_RULES = ("below", "any")
# What becomes of a shard that its folder's index does not list (``unlisted_shards``)
UNLISTED_RULES = ("refuse", "skip")


@dataclass(frozen=True)
class ReaderSettings:
    """The readers' settings a run's config gives; the builders hand each reader its own."""

    max_image_pixels: int = option(
        89_478_485,
        "The most pixels an image may declare: more is refused as corrupt before decoding (a 100 "
        "KB PNG can declare 30000 x 30000, 2.7 GB decoded), skipped under SKIP_CORRUPT. PIL's "
        "default (ImageNet's largest image has 12.6 million); 0: no limit",
        bounds="non_negative",
    )
    max_decompressed_bytes: int = option(
        1 << 30,
        "The most bytes one read of a parquet file may decompress to: a row group's image column, "
        "or a file's label column. What the file declares is checked before pyarrow decompresses "
        "anything (its footer, then every page header as its bytes arrive); more is refused "
        "naming the file and row group. 1 GiB is ten times a row group of a thousand ImageNet "
        "JPEGs",
        bounds="positive",
    )
    max_compression_ratio: float = option(
        100.0,
        "The most a parquet image column may grow by when decompressed (images are stored "
        "compressed: JPEG or PNG bytes shrink little further); checked for column chunks that "
        "declare more than 1 MiB. 0: not checked (MAX_DECOMPRESSED_BYTES still bounds them)",
        bounds="non_negative",
    )
    index_cache: str = option(
        "",
        "Folder of the tar shards' indexes (where each sample's image lies in its shard, built "
        'once per shard by reading it, kept until the shard changes); "" = tar_index/ in '
        "pycls's cache folder ($PYCLS_CACHE_DIR, else $XDG_CACHE_HOME/pycls, else ~/.cache/pycls)",
    )
    verify_shards: str = option(
        "members",
        "How tar shards are held to what was indexed, while the run reads them (docs/trust.md, "
        '"A shard that changes after indexing"). "members": each image is read with its 512-byte '
        "tar header, and the header's CRC-32 and the image's are compared with the ones indexed "
        "(a shard replaced behind byte-identical headers never pairs its images with the old "
        "labels); a URL's reads carry the validator its server gave at indexing (ETag / "
        "Last-Modified: a changed file answers 412) and must state the size indexed; about 0.5 % "
        'more bytes read and 20 us of CPU per 110 KB image. "headers": the header only (an edit '
        "that keeps the size and every header, on a server that sends neither ETag nor "
        'Last-Modified, is read as it is). "sha256" also records each shard\'s SHA-256 when it is '
        "indexed and compares it: a shard at a URL is then read whole (it must fit READAHEAD_MB) "
        "and hashed before any sample of it is used; a local shard's cached index is checked at "
        "each start by reading it. A changed shard stops the run naming it, or under SKIP_CORRUPT "
        "its samples are skipped and named; its index is dropped. BACKEND wds only",
        choices=VERIFY_MODES,
    )
    image_paths: str = option(
        "below",
        "Where a local parquet file's rows may name their images by path (rows holding a path "
        'and no bytes, as Hugging Face datasets writes local image files): "below" the parquet '
        'file\'s own folder (a relative path, or an absolute one that lies there, once ".." and '
        "links are resolved), as a parquet file at a URL always is, since a parquet file is data "
        'anyone may have written; "any" file you can read, for parquet files you wrote yourself '
        "that name images kept elsewhere (docs/trust.md). BACKEND parquet only",
        choices=IMAGE_PATH_RULES,
    )
    unlisted_shards: str = option(
        "refuse",
        "A shard of the split that the folder's index does not list (BACKEND wds and parquet: a "
        "file _info.json names under no split, where it names any; BACKEND shards: a "
        "shard_NNNNN.bin that index.json does not name): left by an earlier preparation into the "
        'same folder, or by one that did not finish. "refuse" stops naming it; "skip" trains only '
        "the listed shards, naming the others once in the log. Either way only what the index "
        "lists is trained (docs/trust.md)",
        choices=UNLISTED_RULES,
    )
