"""Model weights in and out of files of any format (TRAIN.WEIGHTS, model_final.safetensors).

Reads a pycls checkpoint (.pyth, checksum verified), a ``.safetensors`` file, or a torch file
holding a plain state dict (possibly under "model" / "state_dict", possibly with DDP's "module."
prefix), in pycls, timm or torchvision naming (detected from the keys unless given). Loading into
a model adapts what fine-tuning changes on purpose and nothing else:

- a classifier head for another number of classes is dropped (the model keeps its own, freshly
  initialised head) and the fact is logged;
- a position embedding for another image size is resampled (bicubic) by the model itself;
- any other difference (unknown keys, missing keys, other shapes) is an error listing them all.

Files are data: torch files are read with ``weights_only=True``, safetensors hold tensors only.
"""

import json
import logging
import math
import os
import re

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from pycls.atomic_files import atomic_file, atomic_path, write_text_atomic
from pycls.checkpoint import file_kinds, files, single_file
from pycls.errors import UserError
from pycls.models import convert
from pycls.models.cnn import upstream_weights

logger = logging.getLogger(__name__)

FORMATS = ("auto",) + convert.NAMINGS
_HEAD = ("head.weight", "head.bias")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class WeightsError(UserError, ValueError):
    """A weights file cannot be read or does not fit the model; the message names the key the
    user gave it in (TRAIN.WEIGHTS or TEST.WEIGHTS) and says why."""


def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(torch.is_tensor(v) for v in obj.values())


def _strip_wrappers(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def read_state_dict(path: str, key: str = "TRAIN.WEIGHTS") -> dict[str, torch.Tensor]:
    """The tensors of a weights file, in the file's own naming; ``key`` is the config key that
    named the file, for the errors."""
    if not os.path.isfile(path):
        raise WeightsError(f"{key}: {path} does not exist or is not a file")
    if path.endswith(".safetensors") or file_kinds.kind(path) == "safetensors":
        try:
            return load_file(path)
        except Exception as e:
            raise WeightsError(f"{key}: cannot read {path} as safetensors: {e}") from e
    why = file_kinds.not_weights(path)
    if why is not None:
        raise WeightsError(f"{key}: cannot read {path}: {why}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        why = file_kinds.load_failure(path, e)
        raise WeightsError(f"{key}: cannot read {path}: {why}") from e
    if upstream_weights.is_upstream_checkpoint(obj):  # upstream pycls's: no checksum to verify
        return upstream_weights.best_weights(obj, path)
    if isinstance(obj, dict) and "model_state" in obj:  # a pycls checkpoint: verify it
        try:
            return single_file.load_file(path)["model_state"]
        except single_file.CheckpointError as e:
            raise WeightsError(f"{key}: {e}") from e
    for name in ("model", "state_dict", "model_ema"):
        if isinstance(obj, dict) and _is_state_dict(obj.get(name)):
            return obj[name]
    if _is_state_dict(obj):
        return obj
    raise WeightsError(
        f"{key}: {path} holds no state dict (neither a pycls checkpoint nor a dict of "
        "tensors, nor one under 'model' or 'state_dict')"
    )


def read_weights(
    path: str, naming: str = "auto", key: str = "TRAIN.WEIGHTS"
) -> dict[str, torch.Tensor]:
    """The tensors of a weights file in pycls naming (``naming`` "auto" detects it)."""
    if naming not in FORMATS:
        raise WeightsError(f"TRAIN.WEIGHTS_FORMAT: {naming!r} is not one of {list(FORMATS)}")
    state = _strip_wrappers(read_state_dict(path, key))
    if naming == "auto":
        try:
            naming = convert.detect_naming(state)
        except ValueError as e:
            raise WeightsError(f"{key}: {path}: {e}; set TRAIN.WEIGHTS_FORMAT") from None
    logger.info(f"reading {path} ({len(state)} tensors, {naming} naming)")
    return convert.to_pycls(state, naming)


def _head_keys(model) -> tuple[str, ...]:
    """The classifier's weight and bias keys: the ViT's ``head`` (and a distilled ViT's
    ``head_dist``; the keys a head would have where the ViT has none, ``num_classes`` 0), a
    CNN's ``head.fc``."""
    if not hasattr(model, "num_prefix_tokens"):
        return ("head.fc.weight", "head.fc.bias")
    if getattr(model, "head_dist", None) is not None:
        return _HEAD + ("head_dist.weight", "head_dist.bias")
    return _HEAD


def _fit_head(state: dict, model, path: str) -> None:
    """Drops a head for another number of classes from ``state`` (logged), and any head for a
    model without one (``num_classes`` 0: its features)."""
    head = _head_keys(model)
    weight = state.get(head[0])
    own = model.state_dict().get(head[0])
    if weight is not None and own is None:
        for key in head:
            state.pop(key, None)
        logger.info(f"{path}: its head dropped: the model has none (num_classes 0)")
        return
    if weight is None or weight.shape == own.shape:
        return
    if weight.ndim != 2 or weight.shape[1] != own.shape[1]:
        return  # a head of another input width: reported as a shape mismatch
    for key in head:
        state.pop(key, None)
    logger.info(
        f"{path}: its head has {weight.shape[0]} classes, the model {own.shape[0]} "
        "(MODEL.NUM_CLASSES): head dropped, newly initialised (VIT.HEAD_INIT_SCALE)"
    )


def _pos_embed_resamples(incoming: torch.Tensor, own: torch.Tensor, prefix: int) -> bool:
    """Whether the model resamples ``incoming`` into ``own`` (another grid, same prefix/width)."""
    patches = incoming.shape[1] - prefix if incoming.ndim == 3 else -1
    return (
        incoming.ndim == 3
        and incoming.shape[2] == own.shape[2]
        and patches > 0
        and int(patches**0.5) ** 2 == patches
    )


def _lossless(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of ``source`` survives conversion to ``target`` (float16 -> float32
    does; float32 -> float16, float64 -> float32 and float16 <-> bfloat16 do not)."""
    return torch.promote_types(source, target) == target


def check_fit(state: dict, model, path: str, key: str = "TRAIN.WEIGHTS") -> None:
    """Raises WeightsError listing every unknown key, missing key, shape mismatch and dtype
    change that would lose precision."""
    own = model.state_dict()
    head = _head_keys(model)
    missing = [k for k in own if k not in state and k not in head]
    if any(k in state for k in head) and not all(k in state for k in head if k in own):
        missing += [k for k in head if k in own and k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = []
    lossy = sorted(
        f"{name}: file {state[name].dtype}, model {own[name].dtype}"
        for name in state.keys() & own.keys()
        if not _lossless(state[name].dtype, own[name].dtype)
    )
    for name in state.keys() & own.keys():
        if state[name].shape == own[name].shape:
            continue
        if name == "pos_embed" and _pos_embed_resamples(
            state[name], own[name], model.num_prefix_tokens
        ):
            continue
        shapes = f"file {tuple(state[name].shape)}, model {tuple(own[name].shape)}"
        mismatched.append(f"{name}: {shapes}")
    problems = []
    if unexpected:
        problems.append(f"unknown keys (not in the model): {', '.join(sorted(unexpected))}")
    if missing:
        problems.append(f"missing keys (not in the file): {', '.join(sorted(missing))}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(sorted(mismatched))}")
    if lossy:
        problems.append(f"dtypes that would lose precision: {'; '.join(lossy)}")
    if problems:
        hints = layout_hints(state, own)
        raise WeightsError(
            f"{key}: {path} does not fit the model the config describes (check the "
            "model keys, VIT.* or the CNN family's, and TRAIN.WEIGHTS_FORMAT):\n  "
            + "\n  ".join(problems)
            + (f"\n  hint: {'; '.join(hints)}" if hints else "")
        )


# ViT layout features a weights file shows by its keys: (key in pycls naming, what it is, the
# config that gives the model that key, the config that leaves it out)
_VIT_FEATURES = (
    (
        "class_token",
        "a class token (class_token)",
        "VIT.CLASSIFIER token (or VIT.CLASS_TOKEN True to keep it with the pooled classifier)",
        "VIT.CLASSIFIER pooled and VIT.CLASS_TOKEN False",
    ),
    ("fc_norm.weight", "a norm after pooling (fc_norm)", "VIT.FC_NORM True", "VIT.FC_NORM False"),
    (
        "norm_pre.weight",
        "a norm before the first block (norm_pre)",
        "VIT.PRE_NORM True",
        "VIT.PRE_NORM False",
    ),
)


def _tokens_before_patches(state):
    registers = state.get("register_tokens")
    return int("class_token" in state) + (registers.shape[1] if registers is not None else 0)


def layout_hints(state, own):
    """The ViT config keys that would give the model the layout the file ``state`` has (class
    token, registers, norms), and what happens to its position embedding then; [] when the
    difference is not one of layout."""
    if "pos_embed" not in own:
        return []
    hints = []
    for name, what, present, absent in _VIT_FEATURES:
        if name in state and name not in own:
            hints.append(f"the file has {what}: set {present}")
        elif name in own and name not in state:
            hints.append(f"the file has no {what.split(' (')[0].removeprefix('a ')}: set {absent}")
    registers = state.get("register_tokens")
    count = registers.shape[1] if registers is not None else 0
    own_registers = own.get("register_tokens")
    if count != (own_registers.shape[1] if own_registers is not None else 0):
        hints.append(f"the file has {count} register tokens: set VIT.NUM_REGISTERS {count}")
    pos = state.get("pos_embed")
    if hints and pos is not None and pos.ndim == 3 and pos.shape[2] == own["pos_embed"].shape[2]:
        prefix = _tokens_before_patches(state)
        side = math.isqrt(pos.shape[1] - prefix)
        if side * side == pos.shape[1] - prefix:
            own_side = math.isqrt(own["pos_embed"].shape[1] - _tokens_before_patches(own))
            tokens = (
                f"{prefix} token(s) + {side}x{side} patches" if prefix else f"{side}x{side} patches"
            )
            hints.append(
                f"then its position embedding ({tokens}) is resampled to the model's "
                f"{own_side}x{own_side} patches"
            )
    return hints


def _log_dtype_changes(state: dict, model, path: str) -> None:
    own = model.state_dict()
    changes = {}
    for name in state.keys() & own.keys():
        if state[name].dtype != own[name].dtype:
            pair = (state[name].dtype, own[name].dtype)
            changes[pair] = changes.get(pair, 0) + 1
    for (source, target), count in sorted(changes.items(), key=str):
        logger.info(f"{path}: {count} tensors converted from {source} to {target} (no loss)")


def load_weights(
    path: str, model, naming: str = "auto", *, new_head: bool = True, key: str = "TRAIN.WEIGHTS"
) -> None:
    """Loads a weights file of any supported format into ``model`` (a plain VisionTransformer).

    A head for another number of classes is dropped (unless ``new_head`` is False: evaluation
    needs the trained head), a position embedding for another image size resampled; anything
    else that does not fit raises WeightsError listing it, naming ``key`` (the config key that
    named the file). A tensor of another dtype is converted when no value changes (logged), else
    refused.
    """
    state = read_weights(path, naming, key)
    if new_head:
        _fit_head(state, model, path)
    check_fit(state, model, path, key)
    _log_dtype_changes(state, model, path)
    pos = state.get("pos_embed")
    if pos is not None and pos.shape != model.pos_embed.shape:
        logger.info(
            f"{path}: position embedding of {pos.shape[1]} tokens resampled to "
            f"{model.pos_embed.shape[1]} (image size {model.image_size})"
        )
    # Heads left out on purpose are the only keys allowed to be absent here
    result = model.load_state_dict(state, strict=False)
    assert set(result.missing_keys) <= set(_head_keys(model)) and not result.unexpected_keys, result


# ---- writing -----------------------------------------------------------------------------------


def _umask() -> int:
    """This process's umask (reading it means setting it: set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(state: dict[str, torch.Tensor], path: str, metadata: dict | None = None):
    """Writes ``state`` to ``path`` as safetensors, atomically (temporary name, fsync, rename).

    Tensors are copied to contiguous CPU tensors of their own (safetensors refuses tensors
    sharing storage, such as the views of the contiguous-parameter optimizer).
    """
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    metadata = {k: str(v) for k, v in (metadata or {}).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except SafetensorError as e:  # a full disk is an OSError of the file, as for others
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from e
        # safetensors creates its files 0600; weights are for sharing: what open() would give
        os.chmod(tmp, 0o666 & ~_umask())
    return path


def read_metadata(path: str) -> dict[str, str]:
    """The metadata of a safetensors file (pycls stores ``naming`` and the config, ``cfg``)."""
    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a safetensors file, from its header alone (safetensors
    checks the header's offsets against the file's size)."""
    try:
        with safe_open(path, framework="pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            return {k: tuple(f.get_slice(k).get_shape()) for k in names}
    except Exception as e:
        raise WeightsError(f"cannot read {path} as safetensors: {e}") from e


def final_weights_path(out_dir: str) -> str:
    return os.path.join(out_dir, "model_final.safetensors")


# ---- exports for use elsewhere -------------------------------------------------------------------

EXPORT_FORMATS = ("safetensors", "timm", "timm_folder", "torchvision")
# The files of a timm folder (timm.create_model("local-dir:FOLDER", pretrained=True) reads them)
TIMM_CONFIG, TIMM_WEIGHTS = "config.json", "model.safetensors"


def export_model(
    model, cfg_yaml: str, fmt: str, out: str, source: str = "", data_config: dict | None = None
) -> str:
    """Writes ``model``'s weights as ``fmt`` to ``out``; returns ``out``. ``source`` names where
    the model came from in errors.

    ``safetensors``: pycls naming, the config (``cfg_yaml``) as metadata (as model_final).
    ``timm``: timm naming as safetensors, with metadata ``timm_model`` and ``timm_kwargs``
    (JSON): ``timm.create_model(timm_model, **timm_kwargs)`` builds the same network
    (docs/finetuning.md). ``data_config`` (``mean``, ``std``, ``input_size``,
    ``interpolation``, ``crop_pct``, ``crop_mode``: how the model was evaluated) goes into those
    arguments as ``pretrained_cfg_overlay``, so that ``timm.data.resolve_data_config`` on the
    built model gives it back.
    ``timm_folder``: the folder ``out`` as timm stores a model itself (``save_for_hf``'s
    layout): ``config.json`` (the architecture, its ``model_args``, and the ``pretrained_cfg`` with
    the class count and ``data_config``) and ``model.safetensors``, so that
    ``timm.create_model("local-dir:" + out, pretrained=True)`` builds and loads it alone.
    ``torchvision``: a torch file of the state dict in torchvision naming (class-token models
    with a patchify or conv stem only). Features the target cannot express raise WeightsError.
    """
    if fmt not in EXPORT_FORMATS:
        raise WeightsError(f"--format: {fmt!r} is not one of {list(EXPORT_FORMATS)}")
    naming = {"safetensors": "pycls", "timm_folder": "timm"}.get(fmt, fmt)
    try:
        state = convert.from_pycls(model, naming)
        kwargs = convert.timm_create_kwargs(model) if naming == "timm" else None
    except ValueError as e:
        raise WeightsError(f"{source or out}: {e}") from None
    if fmt == "timm_folder":
        return _timm_folder(model, state, kwargs, out, data_config)
    if kwargs is not None and data_config:
        overlay = {k: list(v) if isinstance(v, tuple) else v for k, v in data_config.items()}
        kwargs["pretrained_cfg_overlay"] = {**overlay, "num_classes": kwargs.get("num_classes")}
    if fmt == "torchvision":
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        # an earlier export survives a failed write; a full disk is named, not torch's
        # "unexpected pos"
        with files.guard(out, "write"), atomic_file(out, "wb") as f:
            torch.save({k: v.contiguous().clone() for k, v in state.items()}, f)
        return out
    if fmt == "timm":
        metadata = {"naming": "timm", "timm_model": convert.timm_model_name(model)}
        return save_safetensors(state, out, {**metadata, "timm_kwargs": json.dumps(kwargs)})
    return save_safetensors(state, out, {"naming": "pycls", "cfg": cfg_yaml})


def timm_folder_config(model, kwargs: dict, data_config: dict | None = None) -> dict:
    """The ``config.json`` of a timm folder (timm's own fields, as ``timm.models.save_for_hf``
    writes them): ``architecture``, ``num_classes``, ``num_features``, ``global_pool``,
    ``model_args`` (``kwargs``: what ``timm.create_model`` builds the network from) and
    ``pretrained_cfg`` (the class count, the input size, the first conv and the classifier, and
    how the model was evaluated: ``data_config``'s mean, std, interpolation, crop)."""
    a = model.args
    pretrained_cfg = {
        "num_classes": model.num_classes,
        "input_size": [a.in_channels, a.image_size, a.image_size],
        "fixed_input_size": True,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "custom_load": False,
    }
    for key, value in (data_config or {}).items():
        pretrained_cfg[key] = list(value) if isinstance(value, tuple) else value
    return {
        "architecture": convert.timm_model_name(model),
        "num_classes": model.num_classes,
        "num_features": a.width,
        "global_pool": kwargs["global_pool"],
        "model_args": kwargs,
        "pretrained_cfg": pretrained_cfg,
    }


def _timm_folder(model, state, kwargs, out, data_config):
    """Writes the timm folder ``out``: the weights first, then config.json, each file atomic, so
    that a folder timm can load (it reads config.json first) is always whole."""
    os.makedirs(out, exist_ok=True)
    save_safetensors(state, os.path.join(out, TIMM_WEIGHTS))
    config = timm_folder_config(model, kwargs, data_config)
    with files.guard(out, "write"):
        write_text_atomic(os.path.join(out, TIMM_CONFIG), json.dumps(config, indent=2) + "\n")
    return out


def timm_model_from_export(path: str):
    """The timm model of a file or folder ``export_model`` wrote in timm format, built as
    docs/finetuning.md says: a folder by ``timm.create_model("local-dir:" + path,
    pretrained=True)``; a file by ``timm.create_model`` with its stored name and arguments, then
    a strict load."""
    import timm  # optional: timm users only

    if os.path.isdir(path):
        return timm.create_model(f"local-dir:{path}", pretrained=True).eval()
    meta = read_metadata(path)
    model = timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"]))
    model.load_state_dict(load_file(path))
    return model.eval()
