"""What a config means on the machine that runs it, decided once per run by one step,
``resolve_for_machine``, before any process starts (under torchrun or srun, by every process
alike, from what each sees the same: the CPU's flags, the data's files), and recorded in the
config the run writes (OUT_DIR/config.yaml, every checkpoint):

- values whose size must fit this machine's memory (TRAIN.TOKEN_BUDGET, DATA_LOADER.SHUFFLE_BUFFER:
  ``check_sizes``) are refused when they cannot;
- DATA.PATH as found (``pycls.config.data_source``: a DataSource, found without torch, by the
  command line before the training code loads; a URL read with DATA_LOADER.STORAGE_OPTIONS, its
  ${VAR} from this environment; a path that is not there refused naming the key): tar or parquet
  shards make DATA_LOADER.BACKEND wds or parquet (and the data sets imagefolder unless CIFAR);
  an image folder makes TRAIN.DATASET / TEST.DATASET imagefolder (and a missing TEST.SPLIT of
  val or test the other one); DATA_LOADER.ORDER auto is decided; what was found (for shards,
  the files of each split) is recorded as DATA.SOURCE, which the data builders read instead of
  looking again, as does a run started from its own config.yaml;
- DATA_LOADER.NUM_WORKERS above the CPUs this machine gives each process runs as that many;
- ``DEVICE auto`` becomes ``cpu`` or ``cuda``;
- on a CPU device, ``AMP.CPU_LEVEL`` decides the AMP level (``pycls.engines.cpu_amp``: measured
  where bfloat16 could be kept); the level that runs is written to AMP.LEVEL and CPU_LEVEL
  becomes ``same`` (and AMP.RESIDUAL_DTYPE becomes float32 where the level becomes O0);
- ``VIT.PACKED_ATTENTION auto`` becomes flex or sdpa, and flex is refused by a torch without it.

Each change worth knowing is said in a note. The resolved config is checked again as a whole:
nothing rewrites a key after its check. ``load_cfg`` is ``read_cfg`` (the pure reading,
``pycls.config.loading``) followed by this step.
"""

import logging
import os

import torch

from pycls import distributed as dist
from pycls.config.data_source import find_data_source
from pycls.config.loading import read_cfg
from pycls.config.sections import data
from pycls.config.sections.data import SHARDED_BACKENDS
from pycls.config.validation import assert_cfg
from pycls.engines import cpu_amp
from pycls.errors import require
from pycls.models.vit.token_masks import has_flex_attention

logger = logging.getLogger(__name__)


def load_cfg(cfg_file=None, overrides=(), validate=True, for_this_machine=True, notes=None):
    """Defaults <- YAML file <- KEY VALUE overrides, checked (``read_cfg``) and resolved for this
    machine (``resolve_for_machine``); returns a new frozen CfgNode, final: nothing rewrites it
    later.

    ``for_this_machine`` False returns the config as written (``read_cfg``: a config prepared
    here to run elsewhere, such as a sweep's run configs). The notes of the resolution are
    appended to ``notes`` when given, else logged."""
    c = read_cfg(cfg_file, overrides, validate)
    if validate and for_this_machine:
        c = resolve_for_machine(c, notes)
    return c


def resolve_for_machine(cfg, notes=None, source=None):
    """The config ``cfg`` (checked, as written) means on this machine: a new frozen config,
    resolved and checked again. Resolving a resolved config changes nothing. The notes to show
    are appended to ``notes`` when given, else logged. ``source``: what DATA.PATH holds, when
    already found for ``cfg`` (``find_data_source``, before torch loaded), else found here."""
    c = cfg.clone()
    c.defrost()
    check_sizes(c)
    source = source or find_data_source(c)
    # What DATA.PATH holds decides the data keys (an image folder, tar or parquet shards),
    # then the record of it (the last look at the source here: the builders take it from there)
    use_data_folder(c, source)
    said = use_sharded_data(c, source)
    c.DATA.SOURCE = source.record((c.TRAIN.SPLIT, c.TEST.SPLIT)) if source.path else ""
    data.check_backend_as_found(c)
    if c.DEVICE == "auto":
        c.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    said += _cpu_amp_level(c)
    said += cap_workers(c)
    _packed_attention(c)
    assert_cfg(c)
    c.freeze()
    for note in said:
        notes.append(note) if notes is not None else logger.warning(note)
    return c


# The least an epoch's order takes per sample: one int64 index
_ORDER_BYTES = 8


def memory_bytes():
    """This machine's memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n):
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e6:.3g} MB"


def check_sizes(c, memory=None):
    """Values whose size must fit this machine's memory (``memory`` bytes, default this
    machine's): one micro-batch of TRAIN.TOKEN_BUDGET's patches as the float pixels the model
    takes (each process's share: the launcher's processes, else NUM_PROCS), and a shuffle buffer
    no larger than the largest split whose epoch order (8 bytes a sample) could be held."""
    memory = memory or memory_bytes()
    if not memory:
        return
    t, p = c.TRAIN, c.VIT.PATCH_SIZE
    env = dist.launcher_env()
    shares = (env.world_size if env is not None else max(c.NUM_PROCS, 1)) * t.ACCUM_STEPS
    pixels = t.TOKEN_BUDGET / shares * p * p * 3 * 4
    require(
        pixels <= memory,
        "TRAIN.TOKEN_BUDGET",
        f"{t.TOKEN_BUDGET} patch tokens per step, in micro-batches of {t.TOKEN_BUDGET / shares:.3g}"
        f" ({shares} = processes x TRAIN.ACCUM_STEPS), are pixels that alone take "
        f"{_size(pixels)} a micro-batch as the model reads them ({p}x{p}x3 float32 a patch of "
        f"VIT.PATCH_SIZE {p}), more than this machine's {_size(memory)} of memory",
    )
    largest = memory // _ORDER_BYTES
    require(
        largest >= c.DATA_LOADER.SHUFFLE_BUFFER,
        "DATA_LOADER.SHUFFLE_BUFFER",
        f"{c.DATA_LOADER.SHUFFLE_BUFFER} samples: more than any split this machine can order "
        f"(an epoch's order takes {_ORDER_BYTES} bytes a sample, {_size(memory)} of memory hold "
        f"{largest:.3g}); a buffer as large as the split is already a full shuffle",
    )


def cap_workers(c):
    """DATA_LOADER.NUM_WORKERS above the cores this machine gives each training process (its
    CPUs over the run's processes here) runs as that many: more only take turns on the cores
    (torch warns above them). What is loaded does not change: each sample's augmentation
    depends on its key alone. Returns the note."""
    dl = c.DATA_LOADER
    processes = dist.local_world_size() if dist.launcher_env() is not None else c.NUM_PROCS
    most = max(1, dist.available_cpus() // max(processes, 1))
    if most >= dl.NUM_WORKERS:
        return []
    note = (
        f"DATA_LOADER.NUM_WORKERS {dl.NUM_WORKERS} runs as {most}: this machine gives each of the "
        f"run's {max(processes, 1)} process(es) {most} CPU(s), and more workers would only take "
        "turns on them (the samples and their augmentation are the same)"
    )
    dl.NUM_WORKERS = most
    return [note]


def _cpu_amp_level(c):
    """On a CPU device, the AMP level that runs (AMP.CPU_LEVEL); returns the notes."""
    if c.DEVICE != "cpu":
        return []
    # Processes that load the config on their own (torchrun, srun) must agree: a measurement
    # could differ between them, the CPU's flags cannot
    measure = cpu_amp.measure_cpu_bf16 if dist.launcher_env() is None else None
    level, note = cpu_amp.decide_cpu_level(c.AMP.LEVEL, c.AMP.DTYPE, c.AMP.CPU_LEVEL, measure)
    notes = [note] if note else []
    if level != c.AMP.LEVEL or c.AMP.CPU_LEVEL != "same":
        c.AMP.LEVEL, c.AMP.CPU_LEVEL = level, "same"
    if level == "O0" and c.AMP.RESIDUAL_DTYPE != "float32":
        # a bfloat16 stream is part of O1's autocast, which this CPU does not run
        notes.append(f"AMP.RESIDUAL_DTYPE {c.AMP.RESIDUAL_DTYPE} runs as float32 (AMP.LEVEL O0)")
        c.AMP.RESIDUAL_DTYPE = "float32"
    return notes


def _packed_attention(c):
    """VIT.PACKED_ATTENTION: FlexAttention's block masks where they skip work (CUDA, compiled
    blocks) and nothing rules them out (attention dropout, drop-path skip), the SDPA boolean mask
    otherwise; flex asked for needs a torch that has it."""
    v = c.VIT
    if v.PACKED_ATTENTION == "flex":
        require(
            has_flex_attention(),
            "VIT.PACKED_ATTENTION",
            "flex needs a torch with FlexAttention; use sdpa",
        )
    if v.PACKED_ATTENTION != "auto":
        return
    skip = v.DROP_PATH_MODE == "skip" and v.DROP_PATH > 0
    usable = has_flex_attention() and v.ATTN_DROPOUT == 0 and not skip
    cuda = c.DEVICE == "cuda"
    v.PACKED_ATTENTION = "flex" if cuda and c.TRAIN.COMPILE and usable else "sdpa"


def use_data_folder(c, source=None):
    """Points the data keys at DATA.PATH when it is an image folder (train/ of class folders and
    val/ or test/; ``source``: what DATA.PATH holds, found here when not given), whatever data
    set the config was written for: one key, DATA.PATH, trains a digits or ImageNet config on
    your own images. Other folders (CIFAR pickles) and the shard backends are left alone."""
    source = source or find_data_source(c)
    if c.DATA_LOADER.BACKEND != "torchvision" or source.holds != "image folder":
        return
    c.TRAIN.DATASET = c.TEST.DATASET = "imagefolder"
    if c.TEST.SPLIT in source.splits:
        return
    other = {"val": "test", "test": "val"}.get(c.TEST.SPLIT)
    require(
        other in source.splits,
        "TEST.SPLIT",
        f"{os.path.join(c.DATA.PATH, c.TEST.SPLIT)} is not a folder; DATA.PATH holds "
        f"{list(source.splits)}",
    )
    c.TEST.SPLIT = other


# The data sets pycls knows whose statistics and augmentation do not fit images read from tar or
# parquet shards (the bundled digits, synthetic): they become imagefolder, ImageNet's (imagefolder,
# cifar10 and cifar100 stay)
_NOT_SHARDED = ("digits", "synthetic")


def use_sharded_data(c, source):
    """Reads DATA.PATH as WebDataset tar shards or parquet files when it names such files
    (``source``: what it holds) and BACKEND is torchvision (a note in the returned list says
    so); resolves ORDER auto. Returns the notes."""
    dl, notes, fmt = c.DATA_LOADER, [], source.holds
    if dl.BACKEND == "torchvision" and fmt in SHARDED_BACKENDS:
        dl.BACKEND = fmt
        what = "WebDataset tar shards" if fmt == "wds" else "parquet files"
        notes.append(f"DATA.PATH {c.DATA.PATH} holds {what}: DATA_LOADER.BACKEND {fmt}")
    sharded = dl.BACKEND in ("wds", "parquet")
    if sharded:
        for key in ("TRAIN.DATASET", "TEST.DATASET"):
            section, name = key.split(".")
            if c[section][name] in _NOT_SHARDED:
                c[section][name] = "imagefolder"
    dl.ORDER = data.epoch_order(c)
    return notes
