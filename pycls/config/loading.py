"""Loading and dumping configs: defaults <- YAML file <- ``KEY VALUE`` overrides, upstream pycls's
keys translated on the way (``pycls.config.upstream_keys``), validated, frozen; the resolved config
written as YAML and read back from checkpoints."""

import logging
import os

from yacs.config import CfgNode

from pycls.checkpoint.atomic_files import write_text_atomic
from pycls.config import machine, upstream_keys
from pycls.config.defaults import DEFAULTS, get_default_cfg
from pycls.config.validation import assert_cfg, get
from pycls.datasets import data_sources, remote_files
from pycls.errors import ConfigError, require
from pycls.models.vit.args import VIT_SPECS
from pycls.yaml_keys import (
    MAX_CONFIG_BYTES,
    check_config_text,
    decode_config,
    did_you_mean,
    dotted_keys,
)

logger = logging.getLogger(__name__)
_require = require
# How much of yacs's own message (which shows both values whole) an error repeats
_SHOWN_CHARS = 240


def _merge(c, merge_fn, source):
    """Runs a yacs merge and turns its KeyError / ValueError into a ConfigError naming the key."""
    try:
        merge_fn(source)
    except KeyError as e:
        msg = str(e.args[0]) if e.args else str(e)
        key = msg.split(":")[-1].strip()
        raise _unknown_key(c, key) from None
    except ValueError as e:
        msg = str(e)
        key = msg.rsplit("config key:", 1)[-1].strip() if "config key:" in msg else "config"
        if len(msg) > _SHOWN_CHARS:  # yacs shows both values whole: a list may be megabytes
            msg = msg[:_SHOWN_CHARS] + "..."
        raise ConfigError(f"{key}: wrong type or value ({msg})") from None
    except AssertionError as e:
        msg = str(e)
        if "Non-existent key:" in msg:  # merge_from_list reports unknown keys this way
            raise _unknown_key(c, msg.split("Non-existent key:")[-1].strip()) from None
        raise ConfigError(f"config: {msg}") from None


def _unknown_key(c, key):
    """The error of an unknown key, naming the known keys (ours or upstream's) closest to it."""
    hint = did_you_mean(key, dotted_keys(c) + list(upstream_keys.KEYS))
    return ConfigError(f"{key}: unknown config key{hint}; see pycls/config/defaults.py")


def _ints_to_floats(defaults, other, prefix=""):
    """yacs refuses 1 for a float key; a researcher writing BASE_LR: 1 means 1.0."""
    for key, value in other.items():
        full = prefix + key
        if key not in defaults:
            continue  # yacs reports the unknown key with its full name
        default = defaults[key]
        if isinstance(default, CfgNode) and isinstance(value, dict):
            _ints_to_floats(default, value, full + ".")
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            other[key] = float(value)


def bundled_configs_dir():
    """The configs shipped with pycls: inside the installed package (a wheel carries them as
    pycls/configs), else the checkout's configs/ beside the package (a source or editable
    install)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inside = os.path.join(package, "configs")
    return inside if os.path.isdir(inside) else os.path.join(os.path.dirname(package), "configs")


def bundled_config_names():
    """Names ``--cfg`` accepts for the bundled configs (``quickstart``, ``cifar/vit_ti4_c10``)."""
    root = bundled_configs_dir()
    names = []
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        for f in files:
            if f.endswith(".yaml") and rel != "sweeps":  # sweep files are not run configs
                names.append(os.path.normpath(os.path.join(rel, f[: -len(".yaml")])))
    return sorted(n.replace(os.sep, "/") for n in names)


def resolve_cfg_file(cfg_file):
    """A path that exists wins; otherwise a bundled config by name, with or without ``.yaml`` and
    a leading ``configs/`` (``vit_b16``, ``configs/quickstart.yaml``), so the docs' commands
    also work from an installed wheel outside the checkout. Returns the path to read."""
    if os.path.exists(cfg_file):
        return cfg_file
    name = cfg_file.replace(os.sep, "/")
    name = name[len("configs/") :] if name.startswith("configs/") else name
    candidates = [name] if name.endswith((".yaml", ".yml")) else [name + ".yaml", name]
    for candidate in candidates:
        path = os.path.join(bundled_configs_dir(), candidate)
        if os.path.isfile(path):
            return path
    raise ConfigError(
        f"--cfg: config file {cfg_file!r} does not exist, nor is it a bundled config "
        f"({', '.join(bundled_config_names()) or 'none found'})"
    )


def _merge_file(c, cfg_file, reader):
    cfg_file = resolve_cfg_file(cfg_file)
    if os.path.isdir(cfg_file):
        raise ConfigError(f"--cfg: {cfg_file!r} is a directory; give a YAML file in it")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"--cfg: config file {cfg_file!r} does not exist")
    with open(cfg_file, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)  # a larger file is refused, not read
    text = decode_config(data, cfg_file)
    try:
        check_config_text(text, cfg_file)  # bounded, keys are names, none twice
        other = CfgNode.load_cfg(text)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--cfg: cannot parse {cfg_file}: {e}") from None
    if not other:  # an empty file would silently train on the defaults
        raise ConfigError(f"--cfg: {cfg_file} is empty (no keys); give the config to run")
    if isinstance(other.get("SETUP"), dict) and (
        "SAMPLERS" in other.SETUP or "BASE_CFG" in other.SETUP
    ):
        raise ConfigError(
            f"--cfg: {cfg_file} is a sweep file (it has SETUP.SAMPLERS / SETUP.BASE_CFG), not a "
            f"run config; set its runs up with python tools/sweep_setup.py --sweep-cfg {cfg_file} "
            "ROOT_DIR DIR"
        )
    other = reader.take_file(other, c)  # upstream pycls's keys, put back by reader.apply
    _ints_to_floats(c, other)
    _merge(c, c.merge_from_other_cfg, other)


def _merge_list(c, overrides, reader):
    overrides = list(overrides)
    if len(overrides) % 2:
        raise ConfigError(f"overrides: expected KEY VALUE pairs, got an odd list {overrides}")
    overrides = reader.take_overrides(overrides, c)
    for i in range(0, len(overrides), 2):
        key, value = overrides[i], overrides[i + 1]
        try:
            is_float_key = isinstance(get(c, key), float)
        except KeyError:
            is_float_key = False
        if is_float_key and isinstance(value, str) and value.lstrip("+-").isdigit():
            overrides[i + 1] = str(float(value))
    _merge(c, c.merge_from_list, overrides)


def use_data_folder(c):
    """Points the data keys at DATA.PATH when it is an image folder (train/ of class folders and
    val/ or test/), whatever data set the config was written for: one key, DATA.PATH, trains a
    digits or ImageNet config on your own images. Other folders (CIFAR pickles) and the shard
    backends are left alone; a DATA.PATH that a digits config would ignore is
    refused."""
    path = c.DATA.PATH
    if not path or c.DATA_LOADER.BACKEND != "torchvision":  # own, tar or parquet shards
        return
    train = os.path.join(path, c.TRAIN.SPLIT)
    if not os.path.isdir(train) or not any(e.is_dir() for e in os.scandir(train)):
        _refuse_an_unread_path(c, path)
        return
    c.TRAIN.DATASET = c.TEST.DATASET = "imagefolder"
    if os.path.isdir(os.path.join(path, c.TEST.SPLIT)):
        return
    found = sorted(e.name for e in os.scandir(path) if e.is_dir())
    other = {"val": "test", "test": "val"}.get(c.TEST.SPLIT)
    _require(
        other in found,
        "TEST.SPLIT",
        f"{os.path.join(path, c.TEST.SPLIT)} is not a folder; DATA.PATH holds {found}",
    )
    c.TEST.SPLIT = other


# The bundled data set, which reads no folder: a DATA.PATH given with it would be silently ignored
# (synthetic, which reads none either, is chosen to time a model without data, DATA.PATH or not)
_NO_FOLDER = ("digits",)


def _refuse_an_unread_path(c, path):
    """A DATA.PATH that is not an image folder, given to a config whose data sets are the bundled
    digits, would train on the digits as if DATA.PATH were not there: refused."""
    unread = [s for s in ("TRAIN", "TEST") if c[s].DATASET in _NO_FOLDER]
    if len(unread) < 2:
        return  # a data set that reads DATA.PATH says itself what is wrong with it
    what = "does not exist" if not os.path.exists(path) else "is not an image folder"
    _require(
        False,
        "DATA.PATH",
        f"{path} {what} (train/ and val/ of class folders), and TRAIN.DATASET "
        f"{c.TRAIN.DATASET} reads no folder: it would train on {c.TRAIN.DATASET} as if DATA.PATH "
        "were not given; give an image folder, or set TRAIN.DATASET / TEST.DATASET",
    )


# The data sets whose statistics and augmentation fit images read from tar or parquet shards;
# any other name (the bundled digits, synthetic) becomes imagefolder: ImageNet's
_SHARDED_DATASETS = ("imagefolder", "cifar10", "cifar100")


def use_sharded_data(c):
    """Reads DATA.PATH as WebDataset tar shards or parquet files when it names such files and
    BACKEND is torchvision (a note in the returned list says so); resolves ORDER auto. Returns
    the notes."""
    dl, notes = c.DATA_LOADER, []
    if dl.BACKEND == "torchvision" and c.DATA.PATH:
        try:
            fmt = data_sources.detect_format(c.DATA.PATH)
        except (data_sources.DataSourceError, OSError) as e:
            raise ConfigError(f"DATA.PATH: {e}") from None
        if fmt is not None:
            dl.BACKEND = fmt
            what = "WebDataset tar shards" if fmt == "wds" else "parquet files"
            notes.append(f"DATA.PATH {c.DATA.PATH} holds {what}: DATA_LOADER.BACKEND {fmt}")
    sharded = dl.BACKEND in ("wds", "parquet")
    if sharded:
        for key in ("TRAIN.DATASET", "TEST.DATASET"):
            section, name = key.split(".")
            if c[section][name] not in _SHARDED_DATASETS:
                c[section][name] = "imagefolder"
    if dl.ORDER == "auto":
        streamed = dl.BACKEND == "parquet" or remote_files.is_url(c.DATA.PATH)
        dl.ORDER = "shards" if sharded and streamed else "global"
    return notes


def load_cfg(cfg_file=None, overrides=(), validate=True, for_this_machine=True, notes=None):
    """Defaults <- YAML file <- KEY VALUE overrides, validated and resolved for this machine
    (``pycls.config.machine``: the device, the CPU's AMP level, the number of processes);
    returns a new frozen CfgNode, final: nothing rewrites it later.

    ``for_this_machine`` False leaves DEVICE auto and the AMP level as written (a config
    prepared here to run elsewhere, such as a sweep's run configs). The notes of the
    resolution are appended to ``notes`` when given, else logged."""
    c, lines = _merged(cfg_file, overrides)
    if c.MODEL.ARCH:
        # The preset replaces the defaults, then the file and the overrides are merged on top of
        # it again, so that every VIT key written explicitly wins over the preset
        c, lines = _merged(cfg_file, overrides, arch=c.MODEL.ARCH)
    for line in lines:  # upstream pycls's keys: what each became (pycls.config.upstream_keys)
        logger.warning(line)
    for note in use_sharded_data(c):  # tar or parquet shards named by DATA.PATH, first
        notes.append(note) if notes is not None else logger.warning(note)
    use_data_folder(c)
    if validate:
        assert_cfg(c)
        if for_this_machine:
            for note in machine.resolve(c):
                notes.append(note) if notes is not None else logger.warning(note)
    c.freeze()
    return c


def _merged(cfg_file, overrides, arch=""):
    """Defaults (with the sizes of ``arch`` if given) <- YAML file <- KEY VALUE overrides, and
    upstream pycls's keys translated; returns the config and the translation's log lines."""
    c = get_default_cfg()
    apply_arch(c, arch)
    c.TEST.IM_SIZE = _FOLLOW_TRAIN  # unless the file or the overrides set it
    reader = upstream_keys.Reader()
    if cfg_file:
        _merge_file(c, cfg_file, reader)
    _merge_list(c, overrides, reader)
    lines = reader.apply(c)
    if c.TEST.IM_SIZE == _FOLLOW_TRAIN:
        c.TEST.IM_SIZE = c.TRAIN.IM_SIZE
    return c, lines


# TEST.IM_SIZE while a config loads: not set (yet), evaluate at TRAIN.IM_SIZE
_FOLLOW_TRAIN = 0


def apply_arch(c, arch=None):
    """Sets the VIT size keys to the sizes of the zoo variant ``arch`` (default: MODEL.ARCH)."""
    arch = c.MODEL.ARCH if arch is None else arch
    if not arch:
        return
    _require(arch in VIT_SPECS, "MODEL.ARCH", f"{arch!r} is not one of {sorted(VIT_SPECS)}")
    keys = {"patch_size": "PATCH_SIZE", "depth": "DEPTH", "width": "WIDTH"}
    keys.update(num_heads="NUM_HEADS", mlp_dim="MLP_DIM")
    for arg, key in keys.items():
        c.VIT[key] = VIT_SPECS[arch][arg]


def dump_cfg(c, out_dir=None, name=None):
    """Writes the resolved config as YAML to OUT_DIR/CFG_DEST; returns the path."""
    out_dir = c.OUT_DIR if out_dir is None else out_dir
    path = os.path.join(out_dir, name or c.CFG_DEST)
    os.makedirs(out_dir, exist_ok=True)
    write_text_atomic(path, c.dump())  # a failed write leaves the earlier config.yaml whole
    return path


def non_default_items(c, defaults=None, prefix=""):
    """(dotted key, value) of every key whose value differs from the defaults, in tree order."""
    defaults = DEFAULTS if defaults is None else defaults
    items = []
    for key, value in c.items():
        default = defaults.get(key) if defaults is not None else None
        if isinstance(value, CfgNode):
            items += non_default_items(value, default, f"{prefix}{key}.")
        elif value != default:
            items.append((prefix + key, value))
    return items


def describe_non_default(c):
    """The keys that differ from the defaults, one "KEY: value" line each (what a run logs)."""
    return "\n".join(f"  {key}: {value!r}" for key, value in non_default_items(c))


def cfg_from_yaml_text(text):
    """Rebuilds a config from YAML text (as stored in checkpoints), unvalidated and unfrozen."""
    check_config_text(text, "", "a stored config")  # a file's claim: bounded before it is built
    c = get_default_cfg()
    c.merge_from_other_cfg(CfgNode.load_cfg(text))
    return c
