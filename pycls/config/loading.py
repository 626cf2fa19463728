"""Reading and dumping configs: defaults <- YAML file <- ``KEY VALUE`` overrides, upstream pycls's
keys translated on the way (``pycls.config.upstream_keys``), checked, frozen (``read_cfg``); the
resolved config written as YAML and read back from checkpoints. Pure: no torch, no file but the
YAML (what a config means on the machine that runs it: ``pycls.config.machine``)."""

import json
import logging
import os

import yaml
from yacs.config import CfgNode

from pycls.atomic_files import write_text_atomic
from pycls.config import upstream_keys
from pycls.config.defaults import DEFAULTS, get_default_cfg
from pycls.config.sections.model_vit import VIT_RECORD
from pycls.config.validation import assert_cfg, get
from pycls.errors import ConfigError, require
from pycls.models.vit.args import VIT_SPECS
from pycls.yaml_keys import (
    MAX_CONFIG_BYTES,
    check_config_text,
    decode_config,
    did_you_mean,
    dotted_keys,
    type_mismatch_in_words,
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
        wrong_type = type_mismatch_in_words(key, msg)
        if wrong_type is not None:
            raise ConfigError(wrong_type) from None
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
    return ConfigError(f"{key}: unknown config key{hint}; see pycls/config/sections/")


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
            f"run config; set its runs up with pycls sweep-setup --sweep-cfg {cfg_file} ROOT_DIR "
            "DIR (tools/sweep_setup.py in a checkout)"
        )
    other = reader.take_file(other, c)  # upstream pycls's keys, put back by reader.apply
    _ints_to_floats(c, other)
    _keep_as_text(other, text)
    _merge(c, c.merge_from_other_cfg, other)


# Keys whose value is text that yacs must not read as a Python literal (a JSON object would
# become a dict, then be refused as not text, the refusal showing the value: a token)
_TEXT_KEYS = ("DATA_LOADER.STORAGE_OPTIONS", "DATA.SOURCE")


def _keep_as_text(other, text):
    """A config file's text keys (STORAGE_OPTIONS, DATA.SOURCE) as the text written in ``text``
    (yacs has read a JSON object in one as a Python literal: the written text is read again), a
    mapping written for one as its JSON."""
    raw = None
    for dotted in _TEXT_KEYS:
        group, key = dotted.split(".")
        node = other.get(group)
        if not isinstance(node, dict) or key not in node:
            continue
        raw = yaml.safe_load(text) if raw is None else raw  # bounded: checked before
        written = raw.get(group) if isinstance(raw, dict) else None
        value = written.get(key, node[key]) if isinstance(written, dict) else node[key]
        if isinstance(value, dict):
            value = json.dumps(_plain(value))
        if isinstance(value, str):
            node[key] = repr(value)


def _plain(node):
    return {k: _plain(v) if isinstance(v, dict) else v for k, v in node.items()}


def _merge_list(c, overrides, reader):
    overrides = list(overrides)
    if len(overrides) % 2:
        raise ConfigError(f"overrides: expected KEY VALUE pairs, got an odd list {overrides}")
    overrides = reader.take_overrides(overrides, c)
    for i in range(0, len(overrides), 2):
        key, value = overrides[i], overrides[i + 1]
        if key in _TEXT_KEYS and isinstance(value, str):
            overrides[i + 1] = repr(value)
            continue
        try:
            is_float_key = isinstance(get(c, key), float)
        except KeyError:
            is_float_key = False
        if is_float_key and isinstance(value, str) and value.lstrip("+-").isdigit():
            overrides[i + 1] = str(float(value))
    _merge(c, c.merge_from_list, overrides)


def read_cfg(cfg_file=None, overrides=(), validate=True):
    """Defaults <- YAML file <- KEY VALUE overrides, upstream pycls's keys translated, checked
    (``validate``) and frozen: the config as written. Pure: it imports no torch and reads no file
    but the YAML; what the config means on the machine that runs it (the device, a CPU's AMP
    level, what DATA.PATH holds) is the run's one step after this (``pycls.config.machine``)."""
    c, lines = _merged(cfg_file, overrides)
    if c.MODEL.ARCH:
        # The preset replaces the defaults, then the file and the overrides are merged on top of
        # it again, so that every VIT key written explicitly wins over the preset
        c, lines = _merged(cfg_file, overrides, arch=c.MODEL.ARCH)
    for line in lines:  # upstream pycls's keys: what each became (pycls.config.upstream_keys)
        logger.warning(line)
    if validate:
        assert_cfg(c)
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
    """Sets the VIT keys of the zoo variant ``arch`` (default: MODEL.ARCH): its sizes, and the
    options it has (DeiT III's VIT.LAYER_SCALE_INIT)."""
    arch = c.MODEL.ARCH if arch is None else arch
    if not arch:
        return
    _require(arch in VIT_SPECS, "MODEL.ARCH", f"{arch!r} is not one of {sorted(VIT_SPECS)}")
    for arg, value in VIT_SPECS[arch].items():
        group, key = VIT_RECORD.keys[arg].key.split(".")
        c[group][key] = value


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


def cfg_from_yaml_text(text, where="a stored config"):
    """Rebuilds a config from YAML text (as stored in checkpoints), unvalidated and unfrozen. A
    key this pycls does not know (another version wrote it) or a value of another type is a
    ConfigError naming ``where`` and the key: the model it describes cannot be rebuilt as it
    was."""
    check_config_text(text, "", "a stored config")  # a file's claim: bounded before it is built
    c = get_default_cfg()
    try:
        other = CfgNode.load_cfg(text)
        _keep_as_text(other, text)
        c.merge_from_other_cfg(other)
    except KeyError as e:  # yacs: "Non-existent config key: SECTION.KEY"
        key = str(e.args[0] if e.args else e).rsplit(": ", 1)[-1]
        raise ConfigError(
            f"{where}: {key}: a key this version of pycls does not know (the config was "
            "written by another version); the model it describes cannot be rebuilt here: use "
            "the pycls that wrote it"
        ) from None
    except (ValueError, TypeError, AssertionError, yaml.YAMLError) as e:
        raise ConfigError(f"{where} cannot be read: {' '.join(str(e).split())}") from None
    return c
