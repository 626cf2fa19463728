"""DATA, DATA_LOADER and the data keys of TRAIN and TEST: which data set and split, where its files
are (image folders, CIFAR pickles, prepared shards, WebDataset tars, parquet files, URLs), how
they are read, ordered and augmented (docs/data.md, docs/data_formats.md).

What DATA.PATH holds (an image folder, tar shards, parquet files) is learned on the machine that
runs, not here: ``pycls.config.machine`` reads it once per run and records what it found
(DATA_LOADER.BACKEND, TRAIN.DATASET / TEST.DATASET, TEST.SPLIT, DATA_LOADER.ORDER) in the config.
"""

from pycls.config.sections.key_checks import CfgNode, get, require, show
from pycls.datasets.remote_files import is_url

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.DATA = CfgNode()
_C.DATA_LOADER = CfgNode()
_C.TRAIN = CfgNode()
_C.TEST = CfgNode()

# Root folder of the data set ("" for the bundled digits and the synthetic set). For imagefolder
# it holds train/ and val/ (TRAIN.SPLIT, TEST.SPLIT); for cifar10/cifar100, the python pickles.
# A folder holding TRAIN.SPLIT (train/) of class sub-folders is an image folder whatever data set
# the config names: TRAIN.DATASET and TEST.DATASET become imagefolder, and a TEST.SPLIT of val or
# test that is not there becomes the other one if that is (use_data_folder).
# Also a path or URL (hf://, http(s)://, s3:// ... through fsspec) of WebDataset tar shards or
# parquet files (DATA_LOADER.BACKEND wds / parquet, detected when BACKEND is torchvision): a
# shard pattern (/data/imagenet-train-{000000..001281}.tar, or a glob), a file, or a folder or
# repository (hf://datasets/timm/imagenet-1k-wds) whose files are named for their splits
# (train-00000-of-00100.parquet, SPLIT/ sub-folders); see docs/data_formats.md
_C.DATA.PATH = ""

# Evaluation shards when DATA.PATH names the training split's only (a pattern or a file): a
# pattern, file or folder of the same convention; "" takes TEST.SPLIT from DATA.PATH's folder
_C.DATA.TEST_PATH = ""

# Per-channel normalisation in 0-1 units, applied on the device; empty lists take the data set's
_C.DATA.MEAN = []
_C.DATA.STD = []

# Keep only these classes (of both splits), relabelled 0, 1, ... in the order given; [] keeps all.
# E.g. pretrain on some classes and fine-tune on the others
_C.DATA.CLASSES = []

# Data set: "digits" (bundled), "cifar10", "cifar100", "imagefolder" or "synthetic"
_C.TRAIN.DATASET = "digits"

# Split (sub-folder for imagefolder)
_C.TRAIN.SPLIT = "train"

# Augmentation preset: "default" (the data set's own: imagenet, cifar or digits), "imagenet",
# "cifar", "digits", "none", or a recipe that also sets TRAIN.AUTO_AUGMENT/RANDOM_ERASING-style
# defaults for the transform: "deit" (RandAugment 2/9 + erasing 0.25) or "plain_vit" ("Better plain
# ViT baselines": inception crop + flip + RandAugment 2/10)
_C.TRAIN.AUGMENT = "default"

# Automatic augmentation policy on top of the preset: "none", "randaugment", "trivialaugment",
# "autoaugment" (torchvision.transforms.v2)
_C.TRAIN.AUTO_AUGMENT = "none"

# RandAugment: number of ops and magnitude (0-30)
_C.TRAIN.RAND_AUGMENT_N = 2
_C.TRAIN.RAND_AUGMENT_M = 9

# Random erasing probability (after the other augmentations)
_C.TRAIN.RANDOM_ERASING = 0.0

# Repeated augmentation: each image appears this many times per epoch with different augmentations
# (DeiT), the epoch keeping its length
_C.TRAIN.REPEATED_AUG = 1

# Data set and split for evaluation (same names as TRAIN.DATASET)
_C.TEST.DATASET = "digits"
_C.TEST.SPLIT = "test"

# Worker processes per training process (0 loads in the main process)
_C.DATA_LOADER.NUM_WORKERS = 4

# Page-locked host memory for faster, asynchronous host-to-device copies
_C.DATA_LOADER.PIN_MEMORY = True

# Keep workers alive between epochs
_C.DATA_LOADER.PERSISTENT_WORKERS = True

# Batches each worker prepares ahead
_C.DATA_LOADER.PREFETCH_FACTOR = 4

# Skip (and count) unreadable or corrupt images instead of stopping with an error
_C.DATA_LOADER.SKIP_CORRUPT = False

# The most pixels an image may declare: more is refused as corrupt before decoding (a 100 KB PNG
# can declare 30000 x 30000, 2.7 GB decoded), skipped under SKIP_CORRUPT. PIL's default (ImageNet's
# largest image has 12.6 million); 0: no limit
_C.DATA_LOADER.MAX_IMAGE_PIXELS = 89_478_485

# Where images come from: "torchvision" (decode what DATA.PATH holds: image folders, CIFAR pickles,
# or the bundled digits), "shards" (memory-mapped shards that tools/prepare_dataset.py wrote
# once into SHARD_PATH; TRAIN.DATASET / TEST.DATASET still name the data set they hold), "wds"
# (WebDataset tar shards at DATA.PATH) or "parquet" (Hugging Face parquet files at DATA.PATH).
# torchvision with a DATA.PATH of tar or parquet files becomes wds or parquet when the config
# loads (a note says so), and TRAIN.DATASET / TEST.DATASET become imagefolder unless they name
# cifar10 / cifar100 (ImageNet's statistics and augmentation, or CIFAR's)
_C.DATA_LOADER.BACKEND = "torchvision"

# The order of a training epoch: "global" (one random permutation of every sample), "shards"
# (the shards in random order, their samples through a shuffle buffer of SHUFFLE_BUFFER; each
# process reads whole batches of consecutive samples: the order WebDataset users stream object
# storage in, reading each stretch of a shard once), "resampled" (shards drawn with replacement,
# as WebDataset's resampled=True, as many samples per epoch as the data holds) or "auto" (shards
# for parquet and for URLs, else global; resolved when the config loads). Every order is drawn
# from RNG_SEED and the epoch, so a resume continues at the exact next sample on any number of
# processes. shards and resampled need BACKEND wds or parquet
_C.DATA_LOADER.ORDER = "auto"

# Samples in the shuffle buffer of ORDER shards / resampled (a sample leaves at most this many
# places early; WebDataset and timm use 8192)
_C.DATA_LOADER.SHUFFLE_BUFFER = 8192

# Folder of the tar shards' indexes (where each sample's image lies in its shard, built once per
# shard by reading it, kept until the shard changes); "" = tar_index/ in pycls's cache folder
# ($PYCLS_CACHE_DIR, else $XDG_CACHE_HOME/pycls, else ~/.cache/pycls)
_C.DATA_LOADER.INDEX_CACHE = ""

# Attempts of a read from a URL (a dropped connection, a short answer) before the run stops with
# an error naming the file and the member
_C.DATA_LOADER.RETRIES = 3

# Folder of prepared shards, one sub-folder per split (train/, val/ or test/), for BACKEND shards
_C.DATA_LOADER.SHARD_PATH = ""

# Where the shards backend augments: "cpu" (per sample in the loader workers, the TRAIN.AUGMENT
# preset), "gpu" (whole batches on the CUDA device after the copy, JPEG shards decoded there too;
# presets imagenet, cifar and none) or "auto" (gpu when training on CUDA with such a preset, else
# cpu). Ignored by BACKEND torchvision
_C.DATA_LOADER.AUGMENT_DEVICE = "auto"


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
DATASETS = ("digits", "cifar10", "cifar100", "imagefolder", "synthetic")
CHOICES = {
    "TRAIN.DATASET": DATASETS,
    "TEST.DATASET": DATASETS,
    "TRAIN.AUGMENT": ("default", "imagenet", "cifar", "digits", "none", "deit", "plain_vit"),
    "TRAIN.AUTO_AUGMENT": ("none", "randaugment", "trivialaugment", "autoaugment"),
    "DATA_LOADER.BACKEND": ("torchvision", "shards", "wds", "parquet"),
    "DATA_LOADER.ORDER": ("auto", "global", "shards", "resampled"),
    "DATA_LOADER.AUGMENT_DEVICE": ("auto", "cpu", "gpu"),
}
POSITIVE = ["DATA_LOADER.PREFETCH_FACTOR", "DATA_LOADER.RETRIES"]
NON_NEGATIVE = [
    "DATA_LOADER.NUM_WORKERS",
    "DATA_LOADER.MAX_IMAGE_PIXELS",
    "DATA_LOADER.SHUFFLE_BUFFER",
]
FRACTIONS = ["TRAIN.RANDOM_ERASING"]

# The backends that read shards file by file (and their orders)
SHARDED_BACKENDS = ("wds", "parquet")


def check(c):
    for key in ("DATA.MEAN", "DATA.STD"):
        values = list(get(c, key))
        require(
            len(values) in (0, 3),
            key,
            f"needs 0 (data set default) or 3 values, got {len(values)}: {show(values)}",
        )
    require(all(s > 0 for s in c.DATA.STD), "DATA.STD", "every value must be > 0")
    dl = c.DATA_LOADER
    # A DATA.PATH read by BACKEND torchvision may hold tar or parquet shards: the run's machine
    # step decides (check_backend_as_found)
    if not (dl.BACKEND == "torchvision" and c.DATA.PATH):
        check_backend_as_found(c)
    if dl.BACKEND == "shards":  # prepared shards replace the raw data folder
        require(dl.SHARD_PATH != "", "DATA_LOADER.SHARD_PATH", "BACKEND shards needs the folder")
    elif dl.BACKEND in SHARDED_BACKENDS:
        require(c.DATA.PATH != "", "DATA.PATH", f"BACKEND {dl.BACKEND} needs the shards' path")
    else:
        for split in ("TRAIN", "TEST"):
            key = f"{split}.DATASET"
            if get(c, key) in ("cifar10", "cifar100", "imagefolder"):
                require(c.DATA.PATH != "", "DATA.PATH", f"{key}={get(c, key)} needs a data folder")
    require(
        not (dl.AUGMENT_DEVICE == "gpu" and c.DEVICE == "cpu"),
        "DATA_LOADER.AUGMENT_DEVICE",
        "'gpu' needs a CUDA device, but DEVICE is cpu",
    )
    _check_classes(c)


def check_backend_as_found(c):
    """What needs a shard backend, once the backend is known (written, or found in DATA.PATH)."""
    dl = c.DATA_LOADER
    sharded = dl.BACKEND in SHARDED_BACKENDS
    require(
        sharded or dl.ORDER in ("auto", "global"),
        "DATA_LOADER.ORDER",
        f"{dl.ORDER!r} reads shard by shard: it needs BACKEND wds or parquet, not {dl.BACKEND}",
    )
    require(
        sharded or c.DATA.TEST_PATH == "",
        "DATA.TEST_PATH",
        f"names evaluation shards of BACKEND wds or parquet, not {dl.BACKEND}",
    )


def epoch_order(c):
    """DATA_LOADER.ORDER, with auto as it stands for the backend as it is: shards for parquet and
    for shards read through a URL (streamed), else global."""
    dl = c.DATA_LOADER
    if dl.ORDER != "auto":
        return dl.ORDER
    streamed = dl.BACKEND == "parquet" or is_url(c.DATA.PATH)
    return "shards" if dl.BACKEND in SHARDED_BACKENDS and streamed else "global"


def _check_classes(c):
    classes = list(c.DATA.CLASSES)
    require(
        all(isinstance(k, int) and not isinstance(k, bool) for k in classes),
        "DATA.CLASSES",
        f"must be a flat list of class indices (integers), got {show(classes)}",
    )
    require(
        len(set(classes)) == len(classes) and all(k >= 0 for k in classes),
        "DATA.CLASSES",
        f"must be distinct class indices >= 0, got {show(classes)}",
    )
    require(
        len(classes) <= c.MODEL.NUM_CLASSES,
        "DATA.CLASSES",
        f"keeps {len(classes)} classes, more than MODEL.NUM_CLASSES={c.MODEL.NUM_CLASSES}",
    )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {"skip corrupt": ("DATA_LOADER.SKIP_CORRUPT", lambda c: c.DATA_LOADER.SKIP_CORRUPT)}
