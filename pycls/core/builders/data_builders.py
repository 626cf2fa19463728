"""Data builders: datasets, loaders and device-side batches from the config (the readers,
augmentation presets, shard backends), and the token-budget sampler and loader. Part of the
builders (``pycls.core.builders``, whose face names them).
"""

import functools

from pycls import datasets
from pycls import distributed as dist
from pycls.config import ConfigError
from pycls.config.data_source import find_data_source, read_access, recorded_source
from pycls.config.sections.data import LOADER_RECORD, READER_RECORD, epoch_order
from pycls.core import logging as logs
from pycls.core.builders.model_builders import channels_last
from pycls.datasets import (
    DATASET_STATS,
    DEFAULT_AUGMENT,
    AugmentedDataset,
    DeviceBatches,
    build_transform,
    construct_loader,
)
from pycls.datasets.formats import data_sources, split_index
from pycls.datasets.formats.parquet_shards import ParquetShards
from pycls.datasets.formats.prepared_shards import ShardDataset
from pycls.datasets.formats.reader_settings import ReaderSettings
from pycls.datasets.formats.tar_shards import TarShards, read_info
from pycls.datasets.loading import checks
from pycls.datasets.loading.gpu_augment import (
    DEVICE_PRESETS,
    DeviceAugment,
    DeviceAugmentBatches,
    DeviceAugmentDataset,
    construct_device_loader,
)
from pycls.datasets.loading.loader_settings import LoaderSettings
from pycls.datasets.loading.subset import ClassSubset
from pycls.datasets.loading.token_batches import (
    TokenBudgetDataset,
    TokenBudgetSampler,
    TokenDeviceBatches,
    construct_token_loader,
)
from pycls.datasets.transport import remote_files

logger = logs.get_logger(__name__)

# ------------------------------------------------------------------------------------------------ #
# Data
# ------------------------------------------------------------------------------------------------ #


def dataset_name(cfg, train):
    return cfg.TRAIN.DATASET if train else cfg.TEST.DATASET


def normalisation(cfg, train=True):
    """(mean, std) in 0-1 units: DATA.MEAN / DATA.STD if set, else the data set's own."""
    mean, std = DATASET_STATS[dataset_name(cfg, train)]
    return list(cfg.DATA.MEAN) or list(mean), list(cfg.DATA.STD) or list(std)


def augment_preset(cfg, name):
    return DEFAULT_AUGMENT[name] if cfg.TRAIN.AUGMENT == "default" else cfg.TRAIN.AUGMENT


def augment_on_device(cfg, train):
    """Whether batches are augmented on the device (shards backend, DATA_LOADER.AUGMENT_DEVICE)."""
    dl = cfg.DATA_LOADER
    if dl.BACKEND != "shards" or dl.AUGMENT_DEVICE == "cpu":
        return False
    if train and cfg.TRAIN.TOKEN_BUDGET > 0:
        return False  # each image at its own size, on the CPU ("gpu" is refused at load)

    preset = augment_preset(cfg, dataset_name(cfg, train))
    # Policies applied on top of the preset run per sample on the CPU only.
    extras = cfg.TRAIN.get("AUTO_AUGMENT", "none") != "none" or cfg.TRAIN.get("RANDOM_ERASING", 0)
    supported = preset in DEVICE_PRESETS and not extras
    cuda = dist.resolve_device(cfg.DEVICE).type == "cuda"
    if dl.AUGMENT_DEVICE == "auto":
        return cuda and supported
    if not cuda:
        raise ConfigError("DATA_LOADER.AUGMENT_DEVICE: 'gpu' needs a CUDA device; DEVICE is cpu")
    if not supported:
        raise ConfigError(
            f"DATA_LOADER.AUGMENT_DEVICE: 'gpu' runs the presets {list(DEVICE_PRESETS)} without "
            f"TRAIN.AUTO_AUGMENT or TRAIN.RANDOM_ERASING, not {preset!r} with those; use cpu"
        )
    return True


def _shard_dataset(cfg, name, split, decode):
    path = cfg.DATA_LOADER.SHARD_PATH
    if not path:
        raise ConfigError("DATA_LOADER.SHARD_PATH: BACKEND shards needs the folder of the shards")
    try:
        dl, read = cfg.DATA_LOADER, reader_settings(cfg)
        base = ShardDataset(
            path,
            split,
            decode=decode,
            skip_corrupt=dl.SKIP_CORRUPT,
            max_pixels=read.max_image_pixels,
            unlisted=read.unlisted_shards,
        )
    except FileNotFoundError as e:
        raise ConfigError(f"DATA_LOADER.SHARD_PATH: {e}") from None
    if base.dataset != name:
        raise ConfigError(
            f"DATA_LOADER.SHARD_PATH: {base.folder} holds {base.dataset!r} shards, but the "
            f"config asks for {name!r} (TRAIN.DATASET / TEST.DATASET)"
        )
    return base


def data_source(cfg):
    """What DATA.PATH holds, as the machine step recorded it (DATA.SOURCE: nothing is listed
    again); found here only for a config that no machine step resolved (built in a library
    call), once."""
    return recorded_source(cfg) or find_data_source(cfg)


def sharded_files(cfg, train):
    """(the path the user gave, its key, the files of this split) of BACKEND wds or parquet."""
    path, key, files, _ = _split(cfg, train)
    return path, key, files


def _split(cfg, train):
    """(path, its key, the split's files, their _info.json: "" none, None not looked for), as
    DATA.SOURCE records them; a split it records no files of is refused with the reason
    recorded, or (one whose folder the machine step could not read) looked for again, which
    names the failure."""
    d, role = cfg.DATA, "train" if train else "test"
    own = not train and d.TEST_PATH != ""
    path, key = (d.TEST_PATH, "DATA.TEST_PATH") if own else (d.PATH, "DATA.PATH")
    source = data_source(cfg)
    if role not in dict(source.files) and role not in dict(source.problems):
        source = find_data_source(cfg, again=True)
    try:
        files, info = source.split_files(role)
    except data_sources.DataSourceError as e:
        raise ConfigError(str(e)) from None  # the reason names its key
    return path, key, files, info


def read_window(cfg, train):
    """How many consecutive samples of the file order a batch draws from (TarShards' window):
    the shuffle buffer of a shard-wise order, None for a random order, 0 for an evaluation."""
    dl = cfg.DATA_LOADER
    if not train:
        return 0
    if _epoch_order(cfg) == "global" or cfg.TRAIN.TOKEN_BUDGET > 0:
        return None
    return max(1, dl.SHUFFLE_BUFFER)


def _sharded_dataset(cfg, train):
    """The tar shards (BACKEND wds) or parquet files (parquet) of this split."""
    dl, order = cfg.DATA_LOADER, _epoch_order(cfg)
    path, key, files, where = _split(cfg, train)
    access = read_access(cfg)
    read = reader_settings(cfg)
    common = dict(max_pixels=read.max_image_pixels, retries=dl.RETRIES, where=path, access=access,
                  window=read_window(cfg, train))  # fmt: skip
    # Labels are checked against the model's classes unless DATA.CLASSES picks some of them
    num_classes = None if cfg.DATA.CLASSES else cfg.MODEL.NUM_CLASSES
    # The first file first: a server that is not there is named by the user's URL
    remote_files.file_size(files[0], dl.RETRIES, access)
    if where is None:  # its server did not answer the machine step
        where = data_sources.info_file(files, path, access)
    info = read_info(where or None, dl.RETRIES, access)
    files = split_index.listed_only(files, info, where, key, read.unlisted_shards)
    if dl.BACKEND == "wds":
        base = TarShards(
            files,
            cache_dir=read.index_cache or None,
            info=info,
            num_classes=num_classes,
            skip_corrupt=dl.SKIP_CORRUPT,
            verify=read.verify_shards,
            **common,
        )
        if dist.is_main_proc():  # named with the corrupt samples a run skips
            checks.record_damaged(base.damaged)
        what = "WebDataset tar shards"
    else:
        base = ParquetShards(
            files,
            num_classes=num_classes,
            max_decompressed=read.max_decompressed_bytes,
            max_ratio=read.max_compression_ratio,
            image_paths=read.image_paths,
            **common,
        )
        what = "parquet files"
    said = "read in file order"
    if train:
        buffer = f", buffer {dl.SHUFFLE_BUFFER}" if order != "global" else ""
        said = f"epoch order {order}{buffer}"
        _check_random_access(cfg, base, order)
    logger.info(f"{key} {path}: {len(files)} {what} ({files[0]} ...); {said}{_reading(base)}")
    return base


def _epoch_order(cfg):
    """DATA_LOADER.ORDER as the machine step decided it (auto, for a config none resolved, as
    it stands for the backend)."""
    order = cfg.DATA_LOADER.ORDER
    return epoch_order(cfg) if order == "auto" else order


def _reading(base):
    """How a URL's files are read, for the log line of the split."""
    reader = getattr(base, "_reader", None)
    if reader is None or not remote_files.is_url(getattr(base, "folder", "") or ""):
        return ""
    mib = reader.access.readahead_bytes >> 20
    if not base.serves_ranges:
        return "; the server serves no byte ranges: each file is read whole, streamed"
    if reader.whole_files:
        return f"; each file read whole and kept (what a batch draws from fits READAHEAD_MB {mib})"
    return f"; read by byte ranges, coalesced, {remote_files.FETCHERS} at a time per process"


def _check_random_access(cfg, base, order):
    """A random order over a server without byte ranges would read a whole shard per sample."""
    if getattr(base, "serves_ranges", True):
        return
    first = (getattr(base, "shards", None) or base.files)[0]
    served = (f"the server of {first} serves no byte ranges (it answers a range with the whole "
              "file), so one sample here and one there would each cost a whole file")  # fmt: skip
    if cfg.TRAIN.TOKEN_BUDGET > 0:
        raise ConfigError(
            f"TRAIN.TOKEN_BUDGET: token batches plan one random permutation of the samples, and "
            f"{served}: set TRAIN.TOKEN_BUDGET 0, or serve the files with ranges"
        )
    if order == "global":
        raise ConfigError(
            f"DATA_LOADER.ORDER: global is one random permutation of the samples, and {served}: "
            "set DATA_LOADER.ORDER shards, which streams each shard whole in turn "
            '(docs/data_formats.md, "Servers without byte ranges"), or serve the files with ranges'
        )


def _raw_dataset(cfg, name, split, image_size):
    try:
        return datasets.build_dataset(
            name,
            split=split,
            root=cfg.DATA.PATH,
            image_size=image_size,
            num_classes=cfg.MODEL.NUM_CLASSES,
            num_samples=cfg.TRAIN.BATCH_SIZE * 8 if name == "synthetic" else 0,
            max_pixels=reader_settings(cfg).max_image_pixels,
        )
    except FileNotFoundError as e:  # a path the user gave: one line naming the key
        raise ConfigError(f"DATA.PATH: {e} ({name}, split {split!r})") from None


def _log_split(cfg, base, name, split, train):
    """One line per split saying what was found; a head wider than the training classes trains
    outputs no label ever asks for, which is allowed (fine-tuning later) but rarely meant."""
    n_classes = getattr(base, "num_classes", None)
    where = f" in {base.folder}" if getattr(base, "folder", None) else ""
    logger.info(f"data {name} {split}: {len(base)} images, {n_classes} classes{where}")
    if train and n_classes is not None and n_classes < cfg.MODEL.NUM_CLASSES:
        logger.warning(
            f"MODEL.NUM_CLASSES {cfg.MODEL.NUM_CLASSES} exceeds the {n_classes} classes of "
            f"{name} ({split}): the extra outputs are never a label; set MODEL.NUM_CLASSES "
            f"{n_classes} unless that is meant"
        )


def build_dataset(cfg, train):
    """The augmented dataset for training (train=True) or evaluation, addressed by sampler keys."""
    name = dataset_name(cfg, train)
    split = cfg.TRAIN.SPLIT if train else cfg.TEST.SPLIT
    image_size = cfg.TRAIN.IM_SIZE if train else cfg.TEST.IM_SIZE
    on_device = augment_on_device(cfg, train)
    if cfg.DATA_LOADER.BACKEND == "shards":
        # JPEG shards stay encoded when the device decodes them.
        base = _shard_dataset(cfg, name, split, decode=not on_device)
    elif cfg.DATA_LOADER.BACKEND in ("wds", "parquet"):
        base = _sharded_dataset(cfg, train)
    else:
        base = _raw_dataset(cfg, name, split, image_size)
    if cfg.DATA.CLASSES:
        base = ClassSubset(base, list(cfg.DATA.CLASSES))
    n_classes = getattr(base, "num_classes", None)
    if n_classes is not None and n_classes > cfg.MODEL.NUM_CLASSES:
        raise ConfigError(
            f"MODEL.NUM_CLASSES: {cfg.MODEL.NUM_CLASSES} is fewer than the {n_classes} classes "
            f"of {name} ({split})"
        )
    _log_split(cfg, base, name, split, train)
    preset = augment_preset(cfg, name)
    if on_device:
        skip = cfg.DATA_LOADER.SKIP_CORRUPT
        return DeviceAugmentDataset(base, DeviceAugment(preset, train), train, skip_corrupt=skip)
    t = cfg.TRAIN
    factory = functools.partial(
        build_transform,
        preset,
        auto_augment=t.AUTO_AUGMENT,
        rand_augment_n=t.RAND_AUGMENT_N,
        rand_augment_m=t.RAND_AUGMENT_M,
        random_erasing=t.RANDOM_ERASING,
    )
    return AugmentedDataset(base, factory, train, skip_corrupt=cfg.DATA_LOADER.SKIP_CORRUPT)


def per_process_batch(global_batch, what):
    world = dist.get_world_size()
    if global_batch % world:
        raise ConfigError(f"{what}: {global_batch} is not divisible by the {world} processes")
    return global_batch // world


def build_loader(cfg, train, dataset=None, batch_size=None):
    """The DataLoader of this process's shard (uint8 batches, seeded sampler); for on-device
    augmentation, batches of stored bytes and per-sample parameters instead."""

    dataset = dataset if dataset is not None else build_dataset(cfg, train)
    if train and cfg.TRAIN.TOKEN_BUDGET > 0:
        return build_token_loader(cfg, dataset)
    split = "TRAIN" if train else "TEST"
    # batch_size: a global batch other than the config's (the curriculum's batch scaling)
    batch = per_process_batch(batch_size or cfg[split].BATCH_SIZE, f"{split}.BATCH_SIZE")
    if train:  # the loader yields micro-batches; ACCUM_STEPS of them make one optimizer step
        batch //= cfg.TRAIN.ACCUM_STEPS
    on_device = isinstance(dataset, DeviceAugmentDataset)
    construct = construct_device_loader if on_device else construct_loader
    return construct(
        dataset,
        batch_size=batch,
        shuffle=train,
        drop_last=train,
        seed=cfg.RNG_SEED,
        image_size=cfg[split].IM_SIZE,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        repeats=cfg.TRAIN.REPEATED_AUG if train else 1,
        order=_epoch_order(cfg),
        **loader_settings(cfg).kwargs(),
    )


def reader_settings(cfg):
    """What the readers are held to (``ReaderSettings``), as the DATA_LOADER keys generated from
    its fields give it."""
    return ReaderSettings(**READER_RECORD.arguments_of(cfg))


def loader_settings(cfg):
    """The loader's settings (``LoaderSettings``) as the DATA_LOADER keys generated from its
    fields give them."""
    return LoaderSettings(**LOADER_RECORD.arguments_of(cfg))


def device_batches(cfg, loader, device, train):
    """Wraps a loader so batches arrive on the device, normalised (and augmented there when the
    loader's dataset defers augmentation to the device), as float (channels_last when the model
    is, see MODEL.MEMORY_FORMAT)."""

    mean, std = normalisation(cfg, train)
    cl = channels_last(cfg, device)
    if isinstance(loader.dataset, TokenBudgetDataset):
        return TokenDeviceBatches(loader, device, mean, std)
    if isinstance(loader.dataset, DeviceAugmentDataset):
        return DeviceAugmentBatches(loader, device, mean, std, loader.dataset.augment, cl)
    return DeviceBatches(loader, device, mean, std, cl)


# ------------------------------------------------------------------------------------------------ #
# Token budget (TRAIN.TOKEN_BUDGET): variable grids, padded or packed
# ------------------------------------------------------------------------------------------------ #


def num_prefix_tokens(cfg):
    """The ViT's class and register tokens per image."""
    v = cfg.VIT
    return int(v.CLASSIFIER == "token" or v.CLASS_TOKEN) + v.NUM_REGISTERS


def token_sizes(cfg):
    return list(cfg.TRAIN.TOKEN_SIZES) or [cfg.TRAIN.IM_SIZE]


def token_budget_images(cfg):
    """The images at TRAIN.IM_SIZE that TRAIN.TOKEN_BUDGET holds: the batch the learning rate is
    scaled with."""
    return max(1, cfg.TRAIN.TOKEN_BUDGET // (cfg.TRAIN.IM_SIZE // cfg.VIT.PATCH_SIZE) ** 2)


def build_token_sampler(cfg, num_samples, rank=None, world_size=None):
    """The TokenBudgetSampler of this process (or of ``rank`` of ``world_size``) over
    ``num_samples`` training images."""
    t = cfg.TRAIN
    world = dist.get_world_size() if world_size is None else world_size
    shares = world * t.ACCUM_STEPS
    if t.TOKEN_BUDGET % shares:
        raise ConfigError(
            f"TRAIN.TOKEN_BUDGET: {t.TOKEN_BUDGET} patch tokens do not split evenly into the "
            f"{world} processes x TRAIN.ACCUM_STEPS {t.ACCUM_STEPS} micro-batches of a step"
        )
    try:
        sampler = TokenBudgetSampler(
            num_samples,
            seed=cfg.RNG_SEED,
            patch_size=cfg.VIT.PATCH_SIZE,
            sizes=token_sizes(cfg),
            budget=t.TOKEN_BUDGET // shares,
            max_aspect=t.TOKEN_MAX_ASPECT,
            min_scale=t.TOKEN_MIN_SCALE,
            pack=t.TOKEN_PACKING,
            num_prefix=num_prefix_tokens(cfg),
            rank=dist.get_rank() if rank is None else rank,
            world_size=world,
            accum=t.ACCUM_STEPS,
            repeats=t.REPEATED_AUG,
        )
    except ValueError as e:
        raise ConfigError(f"TRAIN.TOKEN_BUDGET: {e}") from None
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"TRAIN.TOKEN_BUDGET: {t.TOKEN_BUDGET} patch tokens per step take more than the "
            f"{num_samples} training images (no full step to train on)"
        )
    return sampler


def build_token_loader(cfg, dataset):
    """The training loader of token batches: the sampler's planned micro-batches, each loaded
    and collated by one worker."""
    if not isinstance(dataset, AugmentedDataset):
        raise ConfigError("TRAIN.TOKEN_BUDGET: token batches are augmented per image on the CPU")
    dl = cfg.DATA_LOADER
    token_dataset = TokenBudgetDataset(
        dataset,
        patch_size=cfg.VIT.PATCH_SIZE,
        num_prefix=num_prefix_tokens(cfg),
        pack=cfg.TRAIN.TOKEN_PACKING,
    )
    return construct_token_loader(
        token_dataset,
        build_token_sampler(cfg, len(dataset)),
        num_workers=dl.NUM_WORKERS,
        pin_memory=dl.PIN_MEMORY,
        persistent_workers=dl.PERSISTENT_WORKERS,
        prefetch_factor=dl.PREFETCH_FACTOR,
        seed=cfg.RNG_SEED,
        skip_corrupt=dl.SKIP_CORRUPT,
    )
