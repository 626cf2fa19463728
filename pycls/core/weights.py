"""The weights of a trained pycls run, for use elsewhere: the model rebuilt from a checkpoint's
own config, and exports in pycls (safetensors), timm and torchvision naming.

The file formats themselves (reading any weights file, loading into a model, safetensors out)
live in ``pycls.checkpoint.weights``; their names are re-exported here, where pycls users find
them.
"""

import functools
import json
import os

import torch
from safetensors.torch import load_file

from pycls.checkpoint import sharded
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
    model built from the config stored inside, with the stored weights)."""
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
    ``timm``: timm naming as safetensors, with the ``timm_kwargs`` (JSON) that build the same
    network with ``timm.models.vision_transformer.VisionTransformer(**kwargs)`` as metadata.
    ``torchvision``: a torch file of the state dict in torchvision naming (class-token models
    with a patchify or conv stem only). Features the target cannot express raise WeightsError.
    """
    if fmt not in EXPORT_FORMATS:
        raise WeightsError(f"--format: {fmt!r} is not one of {list(EXPORT_FORMATS)}")
    model, cfg = model_from_checkpoint(path)
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    stem = stem[: -len(".pyth")] if stem.endswith(".pyth") else stem.rstrip("/")
    try:
        state = convert.from_pycls(model, "pycls" if fmt == "safetensors" else fmt)
        kwargs = convert.timm_kwargs(model) if fmt == "timm" else None
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    if fmt == "torchvision":
        out = out or f"{stem}_torchvision.pth"
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        torch.save({k: v.contiguous().clone() for k, v in state.items()}, out)
        return out
    if fmt == "timm":
        out = out or f"{stem}_timm.safetensors"
        kwargs["norm_layer_eps"] = kwargs.pop("norm_layer").keywords["eps"]
        return save_safetensors(state, out, {"naming": "timm", "timm_kwargs": json.dumps(kwargs)})
    if out is None:
        out = (
            f"{stem}.safetensors"
            if not path.endswith(".safetensors")
            else f"{stem}_copy.safetensors"
        )
    return save_safetensors(state, out, {"naming": "pycls", "cfg": cfg.dump()})


def timm_model_from_export(path: str):
    """A timm VisionTransformer built from the ``timm_kwargs`` of a file ``export_checkpoint``
    wrote in timm format, with its weights (timm imported here only)."""
    from timm.models.vision_transformer import VisionTransformer  # optional: timm users only

    kwargs = json.loads(read_metadata(path)["timm_kwargs"])
    kwargs["norm_layer"] = functools.partial(torch.nn.LayerNorm, eps=kwargs.pop("norm_layer_eps"))
    model = VisionTransformer(**kwargs)
    model.load_state_dict(load_file(path), strict=True)
    return model.eval()
