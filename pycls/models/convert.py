"""State dicts in other libraries' naming: timm and torchvision <-> pycls.

pycls names (``class_token``, ``blocks.3.ln_1``, ``blocks.3.ffn.fc1``, ``blocks.3.ls_1.gamma``
...) differ from timm's (``cls_token``, ``blocks.3.norm1``, ``blocks.3.mlp.fc1``,
``blocks.3.ls1.gamma``, in its Eva ``blocks.3.gamma_1``) and torchvision's
(``encoder.layers.encoder_layer_3.ln_1``, ``self_attention.in_proj_weight``). Tensors are the
same except where timm keeps them apart and pycls together, each exactly (the same sums):

- timm's ``no_embed_class`` models keep no position-embedding rows for the class and register
  tokens; pycls always has them, rows of zeros;
- Eva's separate ``q_proj``, ``k_proj``, ``v_proj`` are pycls's one ``qkv`` (their rows stacked);
- the parallel block's ``attn_out_proj`` and ``mlp_out_proj`` (timm's default) are pycls's one
  ``out_proj`` (their columns side by side, the biases summed; written back as the attention's
  bias and a zero one for the MLP's);
- Eva's mixed RoPE keeps every block's frequencies in one ``rope.freqs`` (2, depth, ...), pycls
  each block's in its attention (``blocks.3.attn.rope.freqs``).

Keys these functions do not know pass through unchanged, so the loader can list them.
"""

import functools
import math

import torch

from pycls.models.vit import timm_export

NAMINGS = ("pycls", "timm", "torchvision")

# Block-level renames pycls <-> timm (the rest of a block's keys are the same): its
# VisionTransformer's, and its Eva's LayerScales
_TIMM_BLOCK = {"norm1.": "ln_1.", "norm2.": "ln_2.", "mlp.": "ffn.", "ls1.": "ls_1.",
               "ls2.": "ls_2."}  # fmt: skip
_EVA_SCALES = {"gamma_1": "ls_1.gamma", "gamma_2": "ls_2.gamma"}
_TIMM_TOP = {"cls_token": "class_token", "reg_token": "register_tokens"}


def detect_naming(keys) -> str:
    """ "pycls", "timm" or "torchvision", from the keys of a state dict; ValueError if unclear."""
    keys = list(keys)
    if any(k.startswith("encoder.layers.") or k.startswith("conv_proj") for k in keys):
        return "torchvision"
    if any(".ln_1." in k or ".ffn." in k or k == "class_token" for k in keys):
        return "pycls"
    timm_only = (".norm1.", ".mlp.fc1.", ".gamma_1", ".attn_out_proj.", ".attn.q_proj.")
    if any(any(t in k for t in timm_only) or k == "cls_token" for k in keys):
        return "timm"
    if any(".in_proj." in k for k in keys):
        return "pycls"  # parallel blocks without tokens: the two namings are the same
    if any(k.startswith("stem.") for k in keys) and any(k.startswith("s1.b1.") for k in keys):
        return "pycls"  # upstream pycls's CNN families (stem, stages s1.., head), same as ours
    shown = ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
    raise ValueError(f"cannot tell the naming of these weights (keys: {shown})")


def _rename_block(key: str, table: dict[str, str]) -> str:
    if not key.startswith("blocks."):
        return key
    _, index, rest = key.split(".", 2)
    for old, new in table.items():
        if rest.startswith(old):
            return f"blocks.{index}.{new}{rest[len(old) :]}"
    return key


def timm_to_pycls(
    state: dict[str, torch.Tensor], no_embed_class: bool | None = None
) -> dict[str, torch.Tensor]:
    """A state dict of timm's VisionTransformer or Eva in pycls naming (no_embed_class tables
    padded, separate q, k, v stacked, a parallel block's output projections side by side, a
    mixed RoPE's frequencies given to each block). ``no_embed_class``: whether the position
    table lacks the prefix tokens' rows, as the timm model says; None: told from its length (a
    square is patches only)."""
    out = {}
    for key, value in state.items():
        out[_TIMM_TOP.get(key, _rename_block(key, {**_TIMM_BLOCK, **_EVA_SCALES}))] = value
    _stack_qkv(out)
    _join_out_proj(out)
    freqs = out.pop("rope.freqs", None)
    if freqs is not None:  # (2, depth, heads, pairs)
        out.update({f"blocks.{i}.attn.rope.freqs": f.clone() for i, f in
                    enumerate(freqs.unbind(1))})  # fmt: skip
    tokens = ("class_token", "dist_token", "register_tokens")
    prefix = sum(out[k].shape[1] for k in tokens if k in out)
    pos = out.get("pos_embed")
    if prefix and pos is not None and pos.ndim == 3:
        length = pos.shape[1]
        if no_embed_class is None:
            no_embed_class = math.isqrt(length) ** 2 == length and length > 1
        if no_embed_class:  # patches only
            out["pos_embed"] = torch.cat([pos.new_zeros(1, prefix, pos.shape[2]), pos], dim=1)
    return out


def pycls_to_timm(state: dict[str, torch.Tensor], kind: str = "vit") -> dict[str, torch.Tensor]:
    """A pycls state dict in the naming of timm's VisionTransformer (``kind`` "vit") or Eva
    ("eva"), position embedding with prefix rows (timm's default)."""
    top = {v: k for k, v in _TIMM_TOP.items()}
    block = {v: k for k, v in _TIMM_BLOCK.items()}
    if kind == "eva":
        block = {**{v: k for k, v in _EVA_SCALES.items()}, **block}
    state = dict(state)
    _split_out_proj(state)
    freqs = sorted((k for k in state if k.endswith(".attn.rope.freqs")), key=_block_index)
    if freqs:
        state["rope.freqs"] = torch.stack([state.pop(k) for k in freqs], dim=1)
    return {top.get(k, _rename_block(k, block)): v for k, v in state.items()}


def _block_index(key: str) -> int:
    return int(key.split(".")[1])


def _stack_qkv(state: dict) -> None:
    """Eva's separate q_proj, k_proj, v_proj (in place) as one qkv: the weights' rows stacked;
    the biases stacked too when the keys have one, else the queries' and values' as q_bias and
    v_bias (EvaAttention's)."""
    for key in [k for k in state if k.endswith(".attn.q_proj.weight")]:
        base = key[: -len("q_proj.weight")]
        parts = [state.pop(f"{base}{p}_proj.weight") for p in "qkv"]
        state[f"{base}qkv.weight"] = torch.cat(parts)
        biases = {p: state.pop(f"{base}{p}_proj.bias", None) for p in "qkv"}
        if biases["k"] is not None:
            state[f"{base}qkv.bias"] = torch.cat([biases[p] for p in "qkv"])
        elif biases["q"] is not None:
            state[f"{base}q_bias"], state[f"{base}v_bias"] = biases["q"], biases["v"]


def _join_out_proj(state: dict) -> None:
    """timm's parallel block's attn_out_proj and mlp_out_proj (in place) as pycls's one
    out_proj: the columns side by side, the biases summed."""
    for key in [k for k in state if k.endswith(".attn_out_proj.weight")]:
        base = key[: -len("attn_out_proj.weight")]
        attn, mlp = state.pop(key), state.pop(f"{base}mlp_out_proj.weight")
        state[f"{base}out_proj.weight"] = torch.cat([attn, mlp], dim=1)
        bias = state.pop(f"{base}attn_out_proj.bias", None)
        if bias is not None:
            state[f"{base}out_proj.bias"] = bias + state.pop(f"{base}mlp_out_proj.bias")


def _split_out_proj(state: dict) -> None:
    """pycls's parallel out_proj (in place) as timm's attn_out_proj and mlp_out_proj: the
    attention's columns and the bias, the MLP's columns and a zero bias."""
    for key in [k for k in state if k.endswith(".out_proj.weight") and k.startswith("blocks.")]:
        base = key[: -len("out_proj.weight")]
        weight = state.pop(key)
        width = weight.shape[0]
        state[f"{base}attn_out_proj.weight"] = weight[:, :width]
        state[f"{base}mlp_out_proj.weight"] = weight[:, width:]
        bias = state.pop(f"{base}out_proj.bias", None)
        if bias is not None:
            state[f"{base}attn_out_proj.bias"] = bias
            state[f"{base}mlp_out_proj.bias"] = torch.zeros_like(bias)


# pycls <-> torchvision: one table per part of the name, read in both directions
_TV_BLOCK = {  # inside a block; ln_1 and ln_2 are named alike
    "attn.qkv.": "self_attention.in_proj_",
    "attn.proj.": "self_attention.out_proj.",
    "ffn.fc1.": "mlp.0.",
    "ffn.fc2.": "mlp.3.",
}
_TV_STEM_PART = {"conv": "0", "bn": "1"}  # torchvision's Conv2dNormActivation: conv, norm, act
_TV_TOP = {
    "pos_embed": "encoder.pos_embedding",
    "norm.": "encoder.ln.",
    "head.": "heads.head.",
    "pre_logits.0.": "heads.pre_logits.",
}
_TV_LAYER, _TV_STEM_LAYER = "encoder.layers.encoder_layer_", "conv_proj.conv_bn_relu_"


def _replace_prefix(text: str, table: dict[str, str]) -> str | None:
    for old, new in table.items():
        if text.startswith(old):
            return new + text[len(old) :]
    return None


def _torchvision_to_pycls_key(key: str) -> str:
    if key.startswith(_TV_LAYER):
        index, rest = key[len(_TV_LAYER) :].split(".", 1)
        rest = _replace_prefix(rest, {v: k for k, v in _TV_BLOCK.items()}) or rest
        return f"blocks.{index}.{rest}"
    if key.startswith(_TV_STEM_LAYER):
        index, part, rest = key[len(_TV_STEM_LAYER) :].split(".", 2)
        part = {v: k for k, v in _TV_STEM_PART.items()}[part]
        return f"patch_embed.body.{index}.{part}.{rest}"
    # the patch projection is conv_proj, or conv_proj.conv_last after a conv stem
    top = {"conv_proj.conv_last.": "patch_embed.proj.", "conv_proj.": "patch_embed.proj."}
    top.update({v: k for k, v in _TV_TOP.items()})
    return _replace_prefix(key, top) or key  # class_token is named alike


def _pycls_to_torchvision_key(key: str, conv_stem: bool) -> str:
    if key.startswith("blocks."):
        _, index, rest = key.split(".", 2)
        return f"{_TV_LAYER}{index}.{_replace_prefix(rest, _TV_BLOCK) or rest}"
    if key.startswith("patch_embed.body."):
        index, part, rest = key[len("patch_embed.body.") :].split(".", 2)
        return f"{_TV_STEM_LAYER}{index}.{_TV_STEM_PART[part]}.{rest}"
    top = {"patch_embed.proj.": "conv_proj.conv_last." if conv_stem else "conv_proj."}
    top.update(_TV_TOP)
    return _replace_prefix(key, top) or key


def torchvision_to_pycls(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A torchvision VisionTransformer state dict in pycls naming."""
    return {_torchvision_to_pycls_key(k): v for k, v in state.items()}


def pycls_to_torchvision(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pycls state dict in torchvision naming (the inverse of ``torchvision_to_pycls``)."""
    conv_stem = any(k.startswith("patch_embed.body.") for k in state)
    return {_pycls_to_torchvision_key(k, conv_stem): v for k, v in state.items()}


def to_pycls(state: dict[str, torch.Tensor], naming: str) -> dict[str, torch.Tensor]:
    """``state`` (in ``naming``) in pycls naming."""
    if naming == "timm":
        return timm_to_pycls(state)
    if naming == "torchvision":
        return torchvision_to_pycls(state)
    return dict(state)


# ---- what another library can represent ---------------------------------------------------

# The block features torchvision's VisionTransformer has none of: (argument, its value there)
_TORCHVISION_PLAIN = dict(qk_norm="none", layer_scale_init=0.0, block="sequential",
                          norm_layer="layer", proj_bias=True, key_bias=True, rope="none",
                          ffn="mlp", ffn_norm=False, pos_embed="learned")  # fmt: skip


def _torchvision_problems(model) -> list[str]:
    """Features of a pycls model that torchvision's VisionTransformer cannot express."""
    arch, problems = model.arch, []
    problems += [f"{k} {arch[k]!r}" for k, v in _TORCHVISION_PLAIN.items() if arch[k] != v]
    if arch.get("dist_token"):
        problems.append("dist_token (torchvision's ViT has one head)")
    if arch["classifier"] != "token":
        problems.append(f"classifier {arch['classifier']!r} (torchvision reads the class token)")
    if arch["num_registers"]:
        problems.append("num_registers")
    if not arch["qkv_bias"]:
        problems.append("qkv_bias=False")
    if arch["pre_norm"]:
        problems.append("pre_norm")
    if not isinstance(model.fc_norm, torch.nn.Identity):
        problems.append("fc_norm")
    return problems


def timm_target(model):
    """The timm model that represents pycls ``model`` exactly (``pycls.models.vit.timm_export``:
    its class, the name and the arguments ``timm.create_model`` builds it from); ValueError
    naming what timm cannot express."""
    fc_norm = not isinstance(model.fc_norm, torch.nn.Identity)
    return timm_export.timm_target(model.args, num_classes=model.num_classes, fc_norm=fc_norm)


def from_pycls(model, naming: str) -> dict[str, torch.Tensor]:
    """The weights of pycls ``model`` in ``naming``; ValueError naming what cannot be expressed.
    timm's names are those of the class that represents the model (``timm_target``)."""
    if naming not in NAMINGS:
        raise ValueError(f"unknown naming {naming!r}; expected one of {list(NAMINGS)}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if naming == "timm":
        return pycls_to_timm(state, timm_target(model).kind)
    if naming == "torchvision":
        problems = _torchvision_problems(model)
        if problems:
            raise ValueError(f"torchvision cannot represent this model: {', '.join(problems)}")
        return pycls_to_torchvision(state)
    return state


def timm_kwargs(model) -> dict:
    """Arguments of ``timm.models.vision_transformer.VisionTransformer`` for the same network
    (the classes its registered builders would pick given as classes); ValueError for a model
    only timm's Eva represents (``timm_create_kwargs`` and ``to_timm`` cover both)."""
    from timm.layers import LayerNorm, RmsNorm, SwiGLU, SwiGLUPacked  # optional: timm
    from timm.models.vision_transformer import ParallelScalingBlock  # optional: timm

    target = timm_target(model)
    if target.kind != "vit":
        raise ValueError("timm's VisionTransformer cannot represent this model (its Eva can: "
                         "timm_create_kwargs)")  # fmt: skip
    kwargs = dict(target.kwargs)
    norm = LayerNorm if kwargs.pop("norm_layer", "layernorm") == "layernorm" else RmsNorm
    kwargs["norm_layer"] = functools.partial(norm, eps=model.args.norm_eps)
    ffn = model.args.ffn
    if ffn.startswith("swiglu"):
        kwargs.update(
            mlp_layer=SwiGLU if ffn == "swiglu" else SwiGLUPacked, act_layer=torch.nn.SiLU
        )
    if model.args.block == "parallel":
        kwargs["block_fn"] = ParallelScalingBlock
    return kwargs


# timm.create_model needs a registered name; the export's keyword arguments set every size and
# option over the name's own (``pycls.models.vit.timm_export``), which picks the classes. These
# are the names of the ViT of the GELU MLP and of DeiT's distilled one
TIMM_MODEL_NAME = "vit_base_patch16_224"
TIMM_DISTILLED_MODEL_NAME = "deit_base_distilled_patch16_224"
# The LayerNorm eps timm's VisionTransformer uses when no norm_layer is given
TIMM_NORM_EPS = 1e-6


def timm_model_name(model) -> str:
    """The registered timm name whose builder makes ``model``'s class of network."""
    return timm_target(model).name


def timm_create_kwargs(model) -> dict:
    """Keyword arguments of ``timm.create_model(timm_model_name(model), **kwargs)`` for the same
    network: plain JSON values only. ``class_token`` and ``fc_norm`` are always written, since
    timm's defaults for them differ from a pooled pycls model's."""
    return dict(timm_target(model).kwargs)


def to_timm(model):
    """pycls ``model`` as a timm model with its weights, built as ``timm.create_model`` builds
    the export (``timm_model_name``, ``timm_create_kwargs``) and loaded strictly; in the
    model's train/eval mode."""
    import timm  # optional: timm users only

    target = timm_target(model)
    timm_model = timm.create_model(target.name, pretrained=False, **target.kwargs)
    timm_model.load_state_dict(from_pycls(model, "timm"), strict=True)
    return timm_model.train(model.training)
