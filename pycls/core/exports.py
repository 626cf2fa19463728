"""The weights of a trained pycls run, for use elsewhere: the model rebuilt from a checkpoint's
own config (``model_from_checkpoint``), and exported in pycls (safetensors), timm or torchvision
naming (``export_checkpoint``). The file formats themselves live in
``pycls.checkpoint.weight_files``.
"""

import math
import os

import torch

from pycls import config
from pycls.checkpoint import resume, sharded
from pycls.checkpoint.weight_files import (
    EXPORT_FORMATS,
    WeightsError,
    export_model,
    load_weights,
    read_metadata,
    stored_shapes,
)
from pycls.core import builders


def model_from_checkpoint(path: str):
    """(model, cfg) from a pycls checkpoint file or folder, or a pycls safetensors file (the
    model built from the config stored inside, with the stored weights). A run folder or its
    checkpoints/ folder stands for its newest checkpoint."""
    path = resume.find_checkpoint(path, "checkpoint")
    if path.endswith(".safetensors"):
        cfg_text = read_metadata(path).get("cfg") if os.path.isfile(path) else None
        if not cfg_text:
            raise WeightsError(f"{path} holds no pycls config (metadata 'cfg'); cannot rebuild")
        shapes = stored_shapes(path)
    else:
        state = sharded.read_state(path)
        cfg_text = state.get("cfg")
        if not cfg_text:
            raise WeightsError(f"{path} holds no config; cannot rebuild its model")
        shapes = sharded.stored_model_shapes(path, state)
    cfg = config.cfg_from_yaml_text(cfg_text)
    check_claimed_model(path, cfg, shapes)
    model = builders.build_model(cfg)
    if path.endswith(".safetensors"):
        load_weights(path, model, "pycls", new_head=False)
    else:
        sharded.load_model_weights(path, model)  # a file or a sharded folder
    return model.eval(), cfg


def export_checkpoint(path: str, fmt: str, out: str | None = None) -> str:
    """Writes the weights of pycls checkpoint ``path`` for use elsewhere (``export_model``'s
    formats); returns the file, by default named after ``path``."""
    if fmt not in EXPORT_FORMATS:
        raise WeightsError(f"--format: {fmt!r} is not one of {list(EXPORT_FORMATS)}")
    path = resume.find_checkpoint(path, "checkpoint")  # the output is named after the file
    model, cfg = model_from_checkpoint(path)
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    stem = stem[: -len(".pyth")] if stem.endswith(".pyth") else stem.rstrip("/")
    if out is None:
        suffix = {"torchvision": "_torchvision.pth", "timm": "_timm.safetensors"}.get(fmt)
        copy = "_copy" if path.endswith(".safetensors") else ""
        out = stem + (suffix or f"{copy}.safetensors")
    return export_model(model, cfg.dump(), fmt, out, source=path)


def _claimed_blocks(cfg):
    """The blocks the config's model has, from its keys alone; each holds at least one tensor
    (a ResNet's depth is looked up in a table, so it bounds itself)."""
    family = cfg.MODEL.TYPE
    if family == "vit":
        return cfg.VIT.DEPTH
    if family == "regnet":
        return cfg.REGNET.DEPTH
    if family == "anynet":
        return sum(cfg.ANYNET.DEPTHS)
    if family == "effnet":
        return sum(cfg.EN.DEPTHS)
    return 0


def check_claimed_model(path, cfg, shapes):
    """Raises WeightsError unless the model that ``cfg`` (a config stored in ``path``) describes
    fits in the tensors the file holds (``shapes``: name -> shape, read from its headers): its
    blocks at most the file's tensors, its values at most the file's. The model is counted on
    the meta device (no storage), so a few-KB file whose config claims billions of parameters
    is refused before they are allocated."""
    held = sum(math.prod(shape) for shape in shapes.values())
    where = f"{path}: its stored config describes"
    if _claimed_blocks(cfg) > len(shapes):
        raise WeightsError(
            f"{where} {_claimed_blocks(cfg)} blocks; the file holds {len(shapes)} tensors "
            "(a config that does not belong to these weights, or a crafted file)"
        )
    with torch.device("meta"):
        claimed = builders.build_model(cfg)
    needed = sum(t.numel() for t in claimed.state_dict().values())
    if needed > held:
        raise WeightsError(
            f"{where} a model of {needed:,} values; the file holds {held:,} "
            "(a config that does not belong to these weights, or a crafted file): nothing built"
        )
