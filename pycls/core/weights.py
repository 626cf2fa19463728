"""The weights of a trained pycls run, for use elsewhere: the model rebuilt from a checkpoint's
own config, and exports in pycls (safetensors), timm and torchvision naming.

The file formats themselves (reading any weights file, loading into a model, safetensors out)
live in ``pycls.checkpoint.weights``; their names are re-exported here, where pycls users find
them.
"""

import json
import os

import torch
from safetensors.torch import load_file

from pycls.checkpoint import resume, sharded
from pycls.checkpoint.weights import (  # noqa: F401  (re-exported)
    FORMATS,
    WeightsError,
    final_weights_path,
    load_weights,
    read_metadata,
    read_state_dict,
    read_weights,
    save_safetensors,
)
from pycls.core import builders, config
from pycls.models import convert

EXPORT_FORMATS = ("safetensors", "timm", "torchvision")


def model_from_checkpoint(path: str):
    """(model, cfg) from a pycls checkpoint file or folder, or a pycls safetensors file (the
    model built from the config stored inside, with the stored weights). A run folder or its
    checkpoints/ folder stands for its newest checkpoint."""
    path = resume.find_checkpoint(path, "checkpoint")
    if path.endswith(".safetensors"):
        cfg_text = read_metadata(path).get("cfg") if os.path.isfile(path) else None
        if not cfg_text:
            raise WeightsError(f"{path} holds no pycls config (metadata 'cfg'); cannot rebuild")
    else:
        cfg_text = sharded.read_state(path).get("cfg")
        if not cfg_text:
            raise WeightsError(f"{path} holds no config; cannot rebuild its model")
    cfg = config.cfg_from_yaml_text(cfg_text)
    model = builders.build_model(cfg)
    if path.endswith(".safetensors"):
        load_weights(path, model, "pycls", new_head=False)
    else:
        sharded.load_model_weights(path, model)  # a file or a sharded folder
    return model.eval(), cfg


def export_checkpoint(path: str, fmt: str, out: str | None = None) -> str:
    """Writes the weights of pycls checkpoint ``path`` for use elsewhere; returns the file.

    ``safetensors``: pycls naming, config as metadata (as model_final.safetensors).
    ``timm``: timm naming as safetensors, with metadata ``timm_model`` and ``timm_kwargs``
    (JSON): ``timm.create_model(timm_model, **timm_kwargs)`` builds the same network (README).
    ``torchvision``: a torch file of the state dict in torchvision naming (class-token models
    with a patchify or conv stem only). Features the target cannot express raise WeightsError.
    """
    if fmt not in EXPORT_FORMATS:
        raise WeightsError(f"--format: {fmt!r} is not one of {list(EXPORT_FORMATS)}")
    path = resume.find_checkpoint(path, "checkpoint")  # the output is named after the file
    model, cfg = model_from_checkpoint(path)
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    stem = stem[: -len(".pyth")] if stem.endswith(".pyth") else stem.rstrip("/")
    try:
        state = convert.from_pycls(model, "pycls" if fmt == "safetensors" else fmt)
        kwargs = convert.timm_create_kwargs(model) if fmt == "timm" else None
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    if fmt == "torchvision":
        out = out or f"{stem}_torchvision.pth"
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        torch.save({k: v.contiguous().clone() for k, v in state.items()}, out)
        return out
    if fmt == "timm":
        out = out or f"{stem}_timm.safetensors"
        metadata = {"naming": "timm", "timm_model": convert.TIMM_MODEL_NAME}
        return save_safetensors(state, out, {**metadata, "timm_kwargs": json.dumps(kwargs)})
    if out is None:
        out = (
            f"{stem}.safetensors"
            if not path.endswith(".safetensors")
            else f"{stem}_copy.safetensors"
        )
    return save_safetensors(state, out, {"naming": "pycls", "cfg": cfg.dump()})


def timm_model_from_export(path: str):
    """The timm model of a file ``export_checkpoint`` wrote in timm format, built as the README
    says: ``timm.create_model`` with the stored name and arguments, then a strict load."""
    import timm  # optional: timm users only

    meta = read_metadata(path)
    model = timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"]))
    model.load_state_dict(load_file(path))
    return model.eval()
