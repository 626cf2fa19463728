"""What a resumed run may change since its checkpoint: nothing that shapes the model or changes
the optimizer's state; every other OPTIM change is applied and said.

Which keys shape the model is derived from the argument tables the builders build it from
(``pycls.core.builders.FAMILIES``, the tables of the config's sections): an argument that is not
one of its model class's TRAINING_ONLY_ARGS shapes the model, and the keys its reader reads are
compared; no list is kept by hand.
"""

import logging

import yaml

from pycls import config
from pycls.checkpoint import resume
from pycls.checkpoint.files import CheckpointError
from pycls.core import builders
from pycls.yaml_keys import check_config_text

logger = logging.getLogger(__name__)

# Keys whose change makes the saved optimizer state meaningless
OPTIMIZER_KEYS = ("OPTIM.OPTIMIZER",)


def stored_config(path, state):
    """The config a checkpoint was written with, over today's defaults (keys an older or newer
    pycls wrote that this one lacks are left out), or None where there is none to read."""
    text = state.get("cfg")
    if not text:
        return None
    try:  # bounded before anything is built from it (a few aliases can name billions of values)
        check_config_text(str(text), path, f"checkpoint {path}: its stored config")
    except config.ConfigError as e:
        raise CheckpointError(str(e)) from None
    try:
        stored = yaml.safe_load(text)
    except yaml.YAMLError as e:
        logger.warning(f"{path}: its stored config cannot be read ({e}); settings not compared")
        return None
    if not isinstance(stored, dict):
        return None
    c = config.get_default_cfg()
    _merge_known(c, stored)
    return c


def _merge_known(node, values):
    for key, value in values.items():
        if key not in node:
            continue
        if isinstance(node[key], dict):
            if isinstance(value, dict):
                _merge_known(node[key], value)
        else:
            node[key] = value


def _norm(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _changed(old, new, keys):
    out = []
    for key in keys:
        try:
            before, after = config.get(old, key), config.get(new, key)
        except KeyError:
            continue
        if _norm(before) != _norm(after):
            out.append((key, before, after))
    return out


def check_compatible(path, state, cfg):
    """Raises IncompatibleCheckpointError when the model's shape or the optimizer type changed
    since ``path`` was written; logs every other OPTIM change (applied from ``cfg``)."""
    old = stored_config(path, state)
    if old is None:
        return
    if old.MODEL.TYPE == cfg.MODEL.TYPE:  # the keys of the arguments that changed
        keys = set(builders.model_keys(cfg, before=old))
    else:
        keys = {"MODEL.TYPE"}
    refuse_changes(path, _changed(old, cfg, sorted(keys) + list(OPTIMIZER_KEYS)))
    optim_keys = [f"OPTIM.{k}" for k in cfg.OPTIM if f"OPTIM.{k}" not in OPTIMIZER_KEYS]
    optim_keys += [f"MUON.{k}" for k in cfg.MUON]
    for key, before, after in _changed(old, cfg, optim_keys):
        logger.info(f"resume: {key} changed since {path}: {before!r} -> {after!r} (applied)")


def refuse_changes(path, changed):
    """Raises IncompatibleCheckpointError naming ``path`` and each ``(key, before, after)`` of
    ``changed``: settings that change the model's shape or the optimizer's state since the
    checkpoint was written (the caller, which knows the config, works them out)."""
    if not changed:
        return
    what = ", ".join(f"{k}: {b!r} -> {a!r}" for k, b, a in changed)
    raise resume.IncompatibleCheckpointError(
        f"cannot resume from checkpoint {path}: the config changed {what} since it was "
        "written, which changes the model's shape or the optimizer's state. Resume with the "
        "checkpoint's values, or start a new run from its weights: another OUT_DIR and "
        f"TRAIN.WEIGHTS {path}"
    )
