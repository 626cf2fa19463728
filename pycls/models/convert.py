"""State dicts in other libraries' naming: timm and torchvision <-> pycls.

pycls names (``class_token``, ``blocks.3.ln_1``, ``blocks.3.ffn.fc1`` ...) differ from timm's
(``cls_token``, ``blocks.3.norm1``, ``blocks.3.mlp.fc1``) and torchvision's
(``encoder.layers.encoder_layer_3.ln_1``, ``self_attention.in_proj_weight``). Tensors are the
same except one layout detail: timm's ``no_embed_class`` models keep no position-embedding rows
for the class and register tokens; pycls always has them, and rows of zeros give the same sums.

Keys these functions do not know pass through unchanged, so the loader can list them.
"""

import functools
import math

import torch

NAMINGS = ("pycls", "timm", "torchvision")

# Block-level renames pycls <-> timm (the rest of a block's keys are the same)
_TIMM_BLOCK = {"norm1.": "ln_1.", "norm2.": "ln_2.", "mlp.fc1.": "ffn.fc1.", "mlp.fc2.": "ffn.fc2."}
_TIMM_TOP = {"cls_token": "class_token", "reg_token": "register_tokens"}


def detect_naming(keys) -> str:
    """ "pycls", "timm" or "torchvision", from the keys of a state dict; ValueError if unclear."""
    keys = list(keys)
    if any(k.startswith("encoder.layers.") or k.startswith("conv_proj") for k in keys):
        return "torchvision"
    if any(".ln_1." in k or ".ffn." in k or k == "class_token" for k in keys):
        return "pycls"
    if any(".norm1." in k or ".mlp.fc1." in k or k == "cls_token" for k in keys):
        return "timm"
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


def timm_to_pycls(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A timm VisionTransformer state dict in pycls naming (no_embed_class tables padded)."""
    out = {}
    for key, value in state.items():
        out[_TIMM_TOP.get(key, _rename_block(key, _TIMM_BLOCK))] = value
    tokens = ("class_token", "dist_token", "register_tokens")
    prefix = sum(out[k].shape[1] for k in tokens if k in out)
    pos = out.get("pos_embed")
    if prefix and pos is not None and pos.ndim == 3:
        length = pos.shape[1]
        if math.isqrt(length) ** 2 == length and length > 1:  # no_embed_class: patches only
            out["pos_embed"] = torch.cat([pos.new_zeros(1, prefix, pos.shape[2]), pos], dim=1)
    return out


def pycls_to_timm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pycls state dict in timm naming (position embedding with prefix rows, timm's default)."""
    top = {v: k for k, v in _TIMM_TOP.items()}
    block = {v: k for k, v in _TIMM_BLOCK.items()}
    return {top.get(k, _rename_block(k, block)): v for k, v in state.items()}


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


def _unsupported(model, naming: str) -> list[str]:
    """Features of a pycls model that ``naming``'s VisionTransformer cannot express."""
    arch, problems = model.arch, []
    if arch["stem"] != "patchify" and naming == "timm":
        problems.append("stem 'conv' (timm's ViT has a patchify stem)")
    if arch["ffn"] != "mlp":
        problems.append(f"ffn {arch['ffn']!r}")
    if arch["pos_embed"] != "learned":
        problems.append(f"pos_embed {arch['pos_embed']!r}")
    if arch["representation_size"] is not None and naming == "timm":
        problems.append("representation_size (timm's ViT has no pre-logits layer)")
    if arch.get("dist_token") and naming == "timm":
        # timm's VisionTransformerDistilled: class token, distillation token, the final norm
        # before both heads, no registers (its position embedding skips them)
        if arch["classifier"] != "token":
            problems.append("dist_token with classifier 'pooled' (timm's reads the tokens)")
        if arch["num_registers"]:
            problems.append("dist_token with num_registers")
        if not isinstance(model.fc_norm, torch.nn.Identity):
            problems.append("dist_token with fc_norm")
    if naming == "torchvision":
        if arch.get("dist_token"):
            problems.append("dist_token (torchvision's ViT has one head)")
        if arch["classifier"] != "token":
            problems.append("classifier 'pooled' (torchvision reads the class token)")
        if arch["num_registers"]:
            problems.append("num_registers")
        if not arch["qkv_bias"]:
            problems.append("qkv_bias=False")
        if arch["pre_norm"]:
            problems.append("pre_norm")
        if not isinstance(model.fc_norm, torch.nn.Identity):
            problems.append("fc_norm")
    return problems


def from_pycls(model, naming: str) -> dict[str, torch.Tensor]:
    """The weights of pycls ``model`` in ``naming``; ValueError naming what cannot be expressed."""
    if naming not in NAMINGS:
        raise ValueError(f"unknown naming {naming!r}; expected one of {list(NAMINGS)}")
    if naming != "pycls":
        problems = _unsupported(model, naming)
        if problems:
            raise ValueError(f"{naming} cannot represent this model: {', '.join(problems)}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if naming == "timm":
        return pycls_to_timm(state)
    if naming == "torchvision":
        return pycls_to_torchvision(state)
    return state


def timm_kwargs(model) -> dict:
    """Arguments of ``timm.models.vision_transformer.VisionTransformer`` for the same network."""
    problems = _unsupported(model, "timm")
    if problems:
        raise ValueError(f"timm cannot represent this model: {', '.join(problems)}")
    arch = model.arch
    return dict(
        img_size=arch["image_size"],
        patch_size=arch["patch_size"],
        in_chans=arch["in_channels"],
        num_classes=arch["num_classes"],
        global_pool="token" if arch["classifier"] == "token" else "avg",
        embed_dim=arch["width"],
        depth=arch["depth"],
        num_heads=arch["num_heads"],
        mlp_ratio=arch["mlp_dim"] / arch["width"],
        qkv_bias=arch["qkv_bias"],
        class_token=arch["class_token"],
        reg_tokens=arch["num_registers"],
        pre_norm=arch["pre_norm"],
        fc_norm=not isinstance(model.fc_norm, torch.nn.Identity),
        norm_layer=_layer_norm(model.norm if arch["depth"] == 0 else model.blocks[0].ln_1),
    )


# timm.create_model needs a registered name; it only picks timm's ViT builder, since the exported
# keyword arguments set every size (patch, width, depth, heads, MLP) over the name's own. A model
# with DeiT's distillation token takes the distilled builder (VisionTransformerDistilled)
TIMM_MODEL_NAME = "vit_base_patch16_224"
TIMM_DISTILLED_MODEL_NAME = "deit_base_distilled_patch16_224"


def timm_model_name(model) -> str:
    """The registered timm name whose builder makes ``model``'s class of network."""
    return TIMM_DISTILLED_MODEL_NAME if model.arch.get("dist_token") else TIMM_MODEL_NAME


# The LayerNorm eps timm's VisionTransformer uses when no norm_layer is given
TIMM_NORM_EPS = 1e-6


def timm_create_kwargs(model) -> dict:
    """Keyword arguments of ``timm.create_model(TIMM_MODEL_NAME, **kwargs)`` for the same network:
    plain JSON values only, each one timm's ViT accepts. ``class_token`` and ``fc_norm`` are
    always written, since timm's defaults for them differ from a pooled pycls model's."""
    kwargs = timm_kwargs(model)
    eps = kwargs.pop("norm_layer").keywords["eps"]
    if eps != TIMM_NORM_EPS:  # timm takes a norm layer only as an object or a name, not an eps
        raise ValueError(
            f"timm.create_model cannot set LayerNorm eps {eps} (its ViT uses {TIMM_NORM_EPS})"
        )
    return kwargs


def _layer_norm(norm):
    return functools.partial(torch.nn.LayerNorm, eps=norm.eps)
