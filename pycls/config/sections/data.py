"""DATA, DATA_LOADER and the data keys of TRAIN and TEST: which data set and split, where its files
are (image folders, CIFAR pickles, prepared shards, WebDataset tars, parquet files, URLs), how
they are read, ordered and augmented (docs/data.md, docs/data_formats.md).

What DATA.PATH holds (an image folder, tar shards, parquet files) is learned on the machine that
runs, not here: ``pycls.config.machine`` reads it once per run and records what it found
(DATA_LOADER.BACKEND, TRAIN.DATASET / TEST.DATASET, TEST.SPLIT, DATA_LOADER.ORDER) in the config.
"""

import importlib.util
import json

from pycls.config.records import RecordKeys
from pycls.config.sections.key_checks import CfgNode, get, require, show
from pycls.datasets.formats.reader_settings import ReaderSettings
from pycls.datasets.loading.loader_settings import PRESETS, LoaderSettings
from pycls.datasets.transport import url_policy
from pycls.datasets.transport.url_access import is_url

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.DATA = CfgNode()
_C.DATA_LOADER = CfgNode()

# The loader's keys, generated from LoaderSettings's fields (pycls.datasets.loading.loader_settings:
# each with its default, its meaning and its values): NUM_WORKERS, PIN_MEMORY, PERSISTENT_WORKERS,
# PREFETCH_FACTOR, SKIP_CORRUPT, SHUFFLE_BUFFER
LOADER_RECORD = RecordKeys(LoaderSettings, "DATA_LOADER", home="data")
_LOADER_KEYS = LOADER_RECORD.section("data")
_C.DATA_LOADER.update(_LOADER_KEYS.tree.DATA_LOADER)
# How URLs are read, generated from UrlReadSettings's fields (pycls.datasets.transport.url_policy):
# RETRIES, READ_TIMEOUT, MIN_READ_RATE_KB, READAHEAD_MB, STORAGE_OPTIONS
URL_READ_RECORD = RecordKeys(url_policy.UrlReadSettings, "DATA_LOADER", home="data")
_URL_KEYS = URL_READ_RECORD.section("data")
_C.DATA_LOADER.update(_URL_KEYS.tree.DATA_LOADER)
# What the readers are held to, generated from ReaderSettings's fields
# (pycls.datasets.formats.reader_settings): MAX_IMAGE_PIXELS, MAX_DECOMPRESSED_BYTES,
# MAX_COMPRESSION_RATIO, INDEX_CACHE, VERIFY_SHARDS, IMAGE_PATHS, UNLISTED_SHARDS
READER_RECORD = RecordKeys(ReaderSettings, "DATA_LOADER", home="data")
_READER_KEYS = READER_RECORD.section("data")
_C.DATA_LOADER.update(_READER_KEYS.tree.DATA_LOADER)
_RECORDS = (_LOADER_KEYS, _URL_KEYS, _READER_KEYS)
# The generated keys' reference texts (a hand-written key has its comment above it)
REFERENCE = {key: text for keys in _RECORDS for key, text in keys.reference.items()}

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

# What DATA.PATH held when the run's machine step looked, written by it (leave it empty): what it
# holds (an image folder, tar or parquet shards ...), how it is reached and, for shards, the files
# of the training and the evaluation split, as JSON. A run started from its own config.yaml reads
# its data from this record instead of looking again; a record found for another DATA.PATH,
# DATA.TEST_PATH, BACKEND or split is looked for again
_C.DATA.SOURCE = ""

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
# defaults for the transform: "deit" (RandAugment 2/9 + erasing 0.25), "plain_vit" ("Better plain
# ViT baselines": inception crop + flip + torchvision's RandAugment 2/10 of 30), "big_vision" (that
# paper's big_vision config: its crop's aspect ratios, RandAugment 2/10 at TF's full strength),
# "three_augment" (DeiT III: random-resized crop, flip, one of grayscale / solarization / blur,
# colour jitter 0.3), "three_augment_src" (the same after DeiT III's simple random crop) or
# "deit3_finetune" (DeiT III's fine-tuning: random-resized crop, flip, timm's RandAugment
# rand-m9-mstd0.5-inc1; needs timm). The loader's presets (DATA_LOADER.AUGMENT_DEVICE gpu runs
# imagenet, cifar and none)
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
CHOICES = (
    _LOADER_KEYS.choices
    | _READER_KEYS.choices
    | {
        "TRAIN.DATASET": DATASETS,
        "TEST.DATASET": DATASETS,
        "TRAIN.AUGMENT": ("default", *PRESETS),
        "TRAIN.AUTO_AUGMENT": ("none", "randaugment", "trivialaugment", "autoaugment"),
        "DATA_LOADER.BACKEND": ("torchvision", "shards", "wds", "parquet"),
        "DATA_LOADER.ORDER": ("auto", "global", "shards", "resampled"),
        "DATA_LOADER.AUGMENT_DEVICE": ("auto", "cpu", "gpu"),
    }
)
POSITIVE = [key for keys in _RECORDS for key in keys.positive]
NON_NEGATIVE = [key for keys in _RECORDS for key in keys.non_negative]
FRACTIONS = ["TRAIN.RANDOM_ERASING"]
# The presets built on timm's augmentation (pycls.datasets.loading.timm_augment), which needs timm
TIMM_PRESETS = ("deit3_finetune",)

# The backends that read shards file by file (and their orders)
SHARDED_BACKENDS = ("wds", "parquet")


def check_spellings(c):
    """timm's spelling of a data set (``wds/NAME``, ``hfds/NAME``) is refused naming pycls's,
    before the value tables would say only that it is not one of DATASETS: in pycls the reader
    follows from DATA.PATH's files, and the name says whose statistics apply."""
    for key in ("TRAIN.DATASET", "TEST.DATASET"):
        value = str(get(c, key))
        prefix = next((p for p in _TIMM_PREFIXES if value.lower().startswith(p)), None)
        if prefix is None:
            continue
        backend = _TIMM_PREFIXES[prefix]
        reader = "no TensorFlow-datasets reader: prepare the data with tools/prepare_dataset.py"
        if backend:
            reader = f"DATA_LOADER.BACKEND {backend}, chosen from DATA.PATH's files"
        require(
            False,
            key,
            f"{value!r} is timm's spelling; in pycls DATA.PATH names the files (a folder, pattern "
            f"or URL; {reader}) and {key} names the data whose statistics and augmentation apply: "
            "imagefolder (ImageNet's, for any other data), cifar10 or cifar100",
        )


# timm's names for data sets read by a reader of the kind ("wds/imagenet", "hfds/timm/...")
_TIMM_PREFIXES = {"wds/": "wds", "hfds/": "parquet", "hfids/": "parquet", "tfds/": None}


def check(c):
    _check_storage_options(c.DATA_LOADER.STORAGE_OPTIONS)
    _check_source(c.DATA.SOURCE)
    _check_retries(c.DATA_LOADER.RETRIES, c.DATA_LOADER.READ_TIMEOUT)
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
    require(
        c.TRAIN.AUGMENT not in TIMM_PRESETS or importlib.util.find_spec("timm") is not None,
        "TRAIN.AUGMENT",
        f"{c.TRAIN.AUGMENT} runs timm's RandAugment: it needs the timm package (pip install timm, "
        "or pycls-vit[timm])",
    )


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
    require(
        dl.VERIFY_SHARDS != "sha256" or dl.BACKEND == "wds",
        "DATA_LOADER.VERIFY_SHARDS",
        f"'sha256' hashes WebDataset tar shards (BACKEND wds), not {dl.BACKEND}: with it "
        "nothing would be hashed",
    )


def epoch_order(c):
    """DATA_LOADER.ORDER, with auto as it stands for the backend as it is: shards for parquet and
    for shards read through a URL (streamed), else global."""
    dl = c.DATA_LOADER
    if dl.ORDER != "auto":
        return dl.ORDER
    streamed = dl.BACKEND == "parquet" or is_url(c.DATA.PATH)
    return "shards" if dl.BACKEND in SHARDED_BACKENDS and streamed else "global"


# ---- DATA_LOADER.RETRIES and STORAGE_OPTIONS: the transport's rules (url_policy) -------------


def _duration(seconds):
    if seconds > 3.15e7:
        return f"{seconds / 3.15e7:.3g} years"
    return f"{seconds / 3600:.3g} hours"


def _check_retries(retries, read_timeout):
    most_wait = url_policy.MAX_READ_WAIT_S
    require(
        0 < read_timeout <= most_wait,
        "DATA_LOADER.READ_TIMEOUT",
        f"must be more than 0 and at most a day ({most_wait} s), got {read_timeout}",
    )
    most = url_policy.max_retries(read_timeout)
    require(
        most >= retries,
        "DATA_LOADER.RETRIES",
        f"{retries} attempts of a read that keeps failing would take "
        f"{_duration(url_policy.read_wait_s(retries, read_timeout))} before the run says so (up "
        f"to {read_timeout:g} s of a silent server each, DATA_LOADER.READ_TIMEOUT; pauses "
        f"doubling from {url_policy.RETRY_PAUSE:g} s up to {url_policy.MAX_RETRY_PAUSE:g} s); at "
        f"most {most} keep it under a day",
    )


def _check_storage_options(text):
    """DATA_LOADER.STORAGE_OPTIONS: a JSON object, its headers text, its secrets ${VAR} (the
    variables are looked up where the data is read: url_policy.read_access)."""
    problem = url_policy.storage_options_problem(text)
    require(problem is None, "DATA_LOADER.STORAGE_OPTIONS", problem)


def _check_source(text):
    """DATA.SOURCE: empty, or the JSON object a machine step wrote."""
    if not text:
        return
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    require(
        isinstance(record, dict) and "path" in record and "holds" in record,
        "DATA.SOURCE",
        "is not a record the machine step wrote (JSON with the path and what it holds); leave "
        "it empty",
    )


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
FEATURES = _LOADER_KEYS.features
