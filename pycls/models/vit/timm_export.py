"""Which timm model represents a pycls ViT exactly, and how ``timm.create_model`` builds it from
plain JSON values: timm's ``VisionTransformer`` where it can, else its ``Eva`` (RoPE, EVA's q and v
biases), else a ValueError naming what neither can express (``timm_target``).

``timm.create_model`` takes a registered name and keyword arguments over that name's own; classes
(a block, an MLP, a norm of another eps) cannot be JSON, so the name is the one whose builder
picks the classes the model needs, and every argument it sets otherwise is given: timm 1.0.31's
``vit_base_patch16_224`` (the GELU MLP), ``deit_base_distilled_patch16_224`` (DeiT's
distillation token), ``vit_giant_patch14_dinov2`` (packed SwiGLU), ``aimv2_large_patch14_224``
(SwiGLU of two input projections), ``vit_base_patch16_xp_224`` (parallel blocks), and for Eva
``eva_giant_patch14_224`` (LayerNorm eps 1e-6) or ``vit_small_patch16_dinov3`` (eps 1e-5, with
LayerScale). ``timm.create_model`` drops the arguments given as None, so an option a name's
builder sets is turned off by a value that means off (``init_values=0.0`` in timm's
VisionTransformer, ``embed_norm_layer=""``), and where there is none (Eva's ``init_values``) the
name is one whose builder leaves it unset.
"""

import math
from dataclasses import dataclass

VIT_NAMES = {
    "mlp": "vit_base_patch16_224",
    "swiglu_packed": "vit_giant_patch14_dinov2",
    "swiglu": "aimv2_large_patch14_224",
    "parallel": "vit_base_patch16_xp_224",
    "distilled": "deit_base_distilled_patch16_224",
}
EVA_NAMES = {1e-6: "eva_giant_patch14_224", 1e-5: "vit_small_patch16_dinov3"}
# The eps timm's norms have when named by a string ("layernorm", "rmsnorm")
TIMM_NORM_EPS = 1e-6
_TIMM_NORMS = {"layer": "layernorm", "rms": "rmsnorm"}
_ROPE_TYPES = {"axial": "cat", "mixed": "mixed", "dinov3": "dinov3"}


@dataclass(frozen=True)
class TimmTarget:
    """A timm model: its class ("vit" or "eva"), the name ``timm.create_model`` takes, the
    keyword arguments (plain JSON values) that make it the pycls model's network."""

    kind: str
    name: str
    kwargs: dict


def _ratio(hidden: int, width: int) -> float:
    """An MLP ratio r with int(width * r) == hidden, as timm computes the hidden width."""
    r = hidden / width
    while int(width * r) < hidden:
        r = math.nextafter(r, math.inf)
    return r


def _common_problems(a) -> list[str]:
    problems = []
    if a.stem != "patchify":
        problems.append("stem 'conv' (timm's ViTs have a patchify stem)")
    if a.ffn == "local":
        problems.append("ffn 'local'")
    if a.pos_embed == "sincos":
        problems.append("pos_embed 'sincos'")
    if a.representation_size is not None:
        problems.append("representation_size (timm's ViTs have no pre-logits layer)")
    if a.qk_norm not in ("none", a.norm_layer):
        problems.append(f"qk_norm {a.qk_norm!r} with norm_layer {a.norm_layer!r} (timm's norm "
                        "the queries and keys with the model's norm layer)")  # fmt: skip
    return problems


def _vit_problems(a, fc_norm: bool) -> list[str]:
    problems = _common_problems(a)
    if a.rope != "none":
        problems.append("rope (timm's VisionTransformer has no RoPE: its Eva has)")
    if a.qkv_bias and not a.key_bias:
        problems.append("key_bias False (timm's VisionTransformer has a key bias: its Eva has not)")
    if a.norm_eps != TIMM_NORM_EPS:
        problems.append(f"LayerNorm eps {a.norm_eps} (timm.create_model's VisionTransformer "
                        f"norms have {TIMM_NORM_EPS})")  # fmt: skip
    if a.block == "parallel" and not (a.qkv_bias or a.proj_bias):
        problems.append("block 'parallel' without qkv_bias and proj_bias (timm's keeps an MLP "
                        "bias)")  # fmt: skip
    pool_width = a.ffn_hidden * (2 if a.ffn == "swiglu_packed" else 1)
    if a.classifier == "map" and a.mlp_dim != pool_width:
        problems.append("classifier 'map' with an attention pool MLP of another width than the "
                        "blocks' (timm's VisionTransformer gives them one mlp_ratio)")  # fmt: skip
    if a.dist_token:
        # timm's VisionTransformerDistilled: class token, distillation token, the final norm
        # before both heads, no registers (its position embedding skips them)
        if a.classifier != "token":
            problems.append("dist_token with classifier 'pooled' (timm's reads the tokens)")
        if a.num_registers:
            problems.append("dist_token with num_registers")
        if fc_norm:
            problems.append("dist_token with fc_norm")
    return problems


def _eva_problems(a) -> list[str]:
    problems = _common_problems(a)
    if a.dist_token:
        problems.append("dist_token (timm's Eva has no distillation token)")
    if a.block == "parallel":
        problems.append("block 'parallel' (timm's Eva has sequential blocks)")
    if not a.proj_bias:
        problems.append("proj_bias False (timm's Eva keeps the projections' biases)")
    if a.norm_layer != "layer" or a.norm_eps not in EVA_NAMES:
        problems.append(
            f"norm_layer {a.norm_layer!r} of eps {a.norm_eps} (timm.create_model "
            f"builds Eva with LayerNorm of eps {' or '.join(map(str, EVA_NAMES))})"
        )
    if a.norm_eps == 1e-5 and not a.layer_scale_init:
        problems.append("LayerNorm eps 1e-05 without LayerScale (timm's Eva of that eps is "
                        "DINOv3's, which has it)")  # fmt: skip
    if a.ffn == "swiglu_packed" and a.ffn_norm:
        problems.append("ffn 'swiglu_packed' with ffn_norm (timm's Eva has that norm in its "
                        "SwiGLU of two projections only)")  # fmt: skip
    return problems


def _shared_kwargs(a, num_classes: int, fc_norm: bool) -> dict:
    return dict(
        img_size=a.image_size,
        patch_size=a.patch_size,
        in_chans=a.in_channels,
        num_classes=num_classes,
        global_pool={"token": "token", "pooled": "avg", "map": "map"}[a.classifier],
        embed_dim=a.width,
        depth=a.depth,
        num_heads=a.num_heads,
        qkv_bias=a.qkv_bias,
        class_token=a.class_token,
        qk_norm=a.qk_norm != "none",
        init_values=a.layer_scale_init or None,  # None: left unset (every base name leaves it)
    )


def _vit_target(a, num_classes: int, fc_norm: bool) -> TimmTarget:
    """timm's VisionTransformer (or VisionTransformerDistilled) of the same network."""
    kind = "distilled" if a.dist_token else "parallel" if a.block == "parallel" else a.ffn
    packed = a.ffn == "swiglu_packed"
    kwargs = dict(
        _shared_kwargs(a, num_classes, fc_norm),
        mlp_ratio=_ratio(a.ffn_hidden * (2 if packed else 1), a.width),
        reg_tokens=a.num_registers,
        pre_norm=a.pre_norm,
        fc_norm=fc_norm,
    )
    kwargs.update(
        proj_bias=a.proj_bias,
        pos_embed="learn" if a.pos_embed == "learned" else "none",
        norm_layer=_TIMM_NORMS[a.norm_layer],
        scale_mlp_norm=a.ffn_norm,
        no_embed_class=False,
        embed_norm_layer="",  # none (aimv2's builder sets one)
    )
    if kind != "parallel":  # the sequential Block's LayerScale is off for 0 (DINOv2's sets one)
        kwargs["init_values"] = a.layer_scale_init
    if kind == "swiglu":  # aimv2's builder sets its own pooling and token; every other is given
        kwargs.update(act_layer="silu")
    return TimmTarget("vit", VIT_NAMES[kind], kwargs)


def _eva_target(a, num_classes: int, fc_norm: bool) -> TimmTarget:
    """timm's Eva of the same network."""
    swiglu = a.ffn.startswith("swiglu")
    kwargs = dict(
        _shared_kwargs(a, num_classes, fc_norm),
        mlp_ratio=_ratio(a.ffn_hidden, a.width),
        num_reg_tokens=a.num_registers,
        use_pre_transformer_norm=a.pre_norm,
        use_fc_norm=fc_norm,
        use_abs_pos_emb=a.pos_embed == "learned",
        no_embed_class=False,
        qkv_fused=True,
        # a full qkv bias: the RoPE attention of timm's RoPE ViTs; EVA's has no key bias
        attn_type="eva" if a.qkv_bias and not a.key_bias else "rope",
        swiglu_mlp=swiglu,
        # Eva builds the SwiGLU of two projections when it aligns or normalises: align to 1
        swiglu_align_to=1 if a.ffn == "swiglu" and not a.ffn_norm else 0,
        scale_mlp=a.ffn_norm,
        use_rot_pos_emb=a.rope != "none",
        rope_type=_ROPE_TYPES.get(a.rope, "cat"),
        rope_temperature=a.rope_temperature,
        rope_rotate_half=a.rope_layout == "half",
        rope_grid_indexing=a.rope_grid_indexing,
        ref_feat_shape=[a.rope_ref_grid] * 2 if a.rope_ref_grid else None,
        dynamic_img_size=False,
        scale_attn_inner=False,
        attn_only_layer_scale=False,
    )
    if a.classifier == "map":
        kwargs["attn_pool_mlp_ratio"] = _ratio(a.mlp_dim, a.width)
    return TimmTarget("eva", EVA_NAMES.get(a.norm_eps, EVA_NAMES[1e-6]), kwargs)


def timm_target(args, *, num_classes: int, fc_norm: bool) -> TimmTarget:
    """The timm model of the pycls ViT of arguments ``args`` (its ``VitArgs``), ``num_classes``
    outputs and a norm after pooling or not: timm's VisionTransformer where it can express it,
    else its Eva; ValueError listing what neither can."""
    vit = _vit_problems(args, fc_norm)
    if not vit:
        return _vit_target(args, num_classes, fc_norm)
    eva = _eva_problems(args)
    if not eva:
        return _eva_target(args, num_classes, fc_norm)
    raise ValueError(
        f"timm cannot represent this model: {', '.join(vit)} (timm's VisionTransformer); "
        f"{', '.join(eva)} (timm's Eva)"
    )
