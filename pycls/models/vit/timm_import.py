"""timm's Vision Transformers read into ``VitArgs``'s fields: ``VisionTransformer`` (and DeiT's
``VisionTransformerDistilled``) and ``Eva`` of ``timm.models.eva`` (EVA-02, DINOv3, timm's RoPE
ViTs), as timm 1.0.31 builds them. What pycls cannot express exactly is refused by the name of
timm's option (``timm_args``); the weights' names are ``pycls.models.convert``'s.
"""

from torch import nn

__all__ = ["refuse", "timm_args"]


def refuse(option: str, detail: str = "") -> ValueError:
    why = f" ({detail})" if detail else ""
    return ValueError(f"from_timm: timm option {option} is not supported by pycls{why}")


def _rate(module: nn.Module) -> float:
    """Drop probability of an nn.Dropout or timm DropPath (0 for an identity or None)."""
    return float(getattr(module, "p", getattr(module, "drop_prob", 0.0)) or 0.0)


def _norm(norm: nn.Module, option: str = "norm_layer") -> tuple[str, float]:
    """("layer" or "rms", eps) of an affine LayerNorm or RMSNorm; refuses anything else."""
    from timm.layers import RmsNorm  # optional: timm is needed only to convert a timm model

    if isinstance(norm, nn.LayerNorm) and norm.weight is not None and norm.bias is not None:
        return "layer", norm.eps
    if isinstance(norm, RmsNorm | nn.RMSNorm) and norm.weight is not None:
        return "rms", norm.eps
    raise refuse(option, f"got {type(norm).__name__}; pycls has affine LayerNorm and RMSNorm")


def _maybe_norm(norm: nn.Module, option: str):
    return None if isinstance(norm, nn.Identity) else _norm(norm, option)


# ---- the blocks ------------------------------------------------------------------------------


def _attention(attn: nn.Module, width: int) -> dict:
    """The settings of timm's Attention, EvaAttention or AttentionRope."""
    from timm.layers import Attention, AttentionRope  # optional, as above
    from timm.models.eva import EvaAttention  # optional, as above

    if type(attn) not in (Attention, AttentionRope, EvaAttention):
        raise refuse("attn_layer", f"{type(attn).__name__}; pycls has timm's Attention")
    if attn.num_heads * attn.head_dim != width:
        raise refuse("attn_head_dim", "the attention's width must equal embed_dim")
    if getattr(attn, "gate", None) is not None:
        raise refuse("gated attention")
    if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
        raise refuse("scale_attn_norm / scale_attn_inner", "a norm of the attention's output")
    if getattr(attn, "num_kv_groups", 1) != 1:
        raise refuse("num_kv_heads", "grouped-query attention")
    if getattr(attn, "qkv", None) is not None:
        separate_bias = getattr(attn, "q_bias", None) is not None  # EvaAttention: no key bias
        qkv_bias, key_bias = separate_bias or attn.qkv.bias is not None, not separate_bias
    else:  # q_proj, k_proj, v_proj
        qkv_bias, key_bias = attn.q_proj.bias is not None, attn.k_proj.bias is not None
        if key_bias and not qkv_bias:
            raise refuse("qkv_bias", "a key bias without a query bias")
    qk = _maybe_norm(attn.q_norm, "qk_norm")
    return dict(
        num_heads=attn.num_heads,
        qkv_bias=qkv_bias,
        key_bias=key_bias or not qkv_bias,
        qk_norm="none" if qk is None else qk[0],
        # the queries' and keys' norms may be of another kind (qk_norm), not of another eps
        norms=[] if qk is None else [(None, qk[1]), (None, _norm(attn.k_norm, "qk_norm")[1])],
        proj_bias=attn.proj.bias is not None,
        attn_dropout=_rate(attn.attn_drop),
        drops=[_rate(attn.proj_drop)],
        rotate_half=bool(getattr(attn, "rotate_half", False)),
    )


def _mlp(mlp: nn.Module) -> dict:
    """The settings of timm's Mlp (GELU), GluMlp / SwiGLUPacked or SwiGLU (SiLU)."""
    from timm.layers import GluMlp, Mlp, SwiGLU  # optional, as above

    if type(mlp) is Mlp and isinstance(mlp.fc1, nn.Linear):
        if type(mlp.act) is not nn.GELU or mlp.act.approximate != "none":
            raise refuse("act_layer", f"{mlp.act}; pycls's MLP uses exact GELU")
        ffn, hidden, first = "mlp", mlp.fc1.out_features, [mlp.fc1]
    elif type(mlp) is GluMlp and isinstance(mlp.fc1, nn.Linear) and not mlp.gate_last:
        ffn, hidden, first = "swiglu_packed", mlp.fc1.out_features // 2, [mlp.fc1]
    elif type(mlp) is SwiGLU:
        ffn, hidden, first = "swiglu", mlp.fc1_g.out_features, [mlp.fc1_g, mlp.fc1_x]
    else:
        raise refuse("mlp_layer", f"{type(mlp).__name__}; pycls has Mlp, SwiGLUPacked, SwiGLU")
    if ffn != "mlp" and type(mlp.act) is not nn.SiLU:
        raise refuse("act_layer", f"{mlp.act}; pycls's SwiGLU uses SiLU")
    biases = {layer.bias is not None for layer in [*first, mlp.fc2]}
    if len(biases) != 1:
        raise refuse("bias", "the MLP's layers differ in having a bias")
    hidden_norm = _maybe_norm(mlp.norm, "scale_mlp_norm")
    return dict(
        ffn=ffn,
        mlp_dim=hidden,
        ffn_norm=hidden_norm is not None,
        norms=[] if hidden_norm is None else [hidden_norm],
        mlp_bias=biases.pop(),
        drops=[_rate(mlp.drop1), _rate(mlp.drop2)],
    )


def _scale(ls: nn.Module | None, init) -> float:
    """LayerScale's initial value (0: none), from timm's module (``ls1``) or its init_values."""
    if ls is None or isinstance(ls, nn.Identity):
        return 0.0
    value = getattr(ls, "init_values", init)
    return float(value) if value else 1.0


def _sequential_block(block: nn.Module, width: int) -> dict:
    """timm's Block or EvaBlock."""
    eva = hasattr(block, "gamma_1")
    scales = [block.gamma_1, block.gamma_2] if eva else [block.ls1, block.ls2]
    values = [_scale(s, getattr(block, "init_values", None)) for s in scales]
    if (values[0] > 0) != (values[1] > 0):
        raise refuse("attn_only_layer_scale", "LayerScale on one branch only")
    attn, mlp = _attention(block.attn, width), _mlp(block.mlp)
    if mlp.pop("mlp_bias") != attn["proj_bias"]:
        raise refuse("proj_bias", "the attention's output projection and the MLP differ in bias")
    settings = {**attn, **mlp, "layer_scale_init": values[0], "block": "sequential"}
    settings["norms"] = [_norm(block.norm1), _norm(block.norm2), *attn["norms"], *mlp["norms"]]
    settings["drops"] = attn["drops"] + mlp["drops"]
    settings["drop_path"] = _rate(block.drop_path1)
    return settings


def _parallel_block(block: nn.Module, width: int) -> dict:
    """timm's ParallelScalingBlock (ViT-22B's block)."""
    if type(block.mlp_act) is not nn.GELU or block.mlp_act.approximate != "none":
        raise refuse("act_layer", f"{block.mlp_act}; pycls's parallel block uses exact GELU")
    outs = [block.out_proj] if block.out_proj is not None else [
        block.attn_out_proj, block.mlp_out_proj]  # fmt: skip
    proj_bias = outs[0].bias is not None
    qkv_bias = block.in_proj.bias is not None
    if block.mlp_bias is not None and not proj_bias:
        raise refuse("proj_bias=False", "timm's parallel block keeps an MLP bias without qkv_bias")
    qk = _maybe_norm(block.q_norm, "qk_norm")
    return dict(
        block="parallel",
        num_heads=block.num_heads,
        qkv_bias=qkv_bias,
        key_bias=True,
        qk_norm="none" if qk is None else qk[0],
        proj_bias=proj_bias,
        ffn="mlp",
        mlp_dim=block.in_split[0],
        ffn_norm=False,
        layer_scale_init=_scale(block.ls, None),
        norms=[_norm(block.in_norm)] + ([] if qk is None else [(None, qk[1])]),
        attn_dropout=_rate(block.attn_drop),
        drops=[_rate(block.mlp_drop)],
        rotate_half=False,
        drop_path=_rate(block.drop_path),
    )


def _blocks(model: nn.Module, width: int) -> dict:
    """The settings every block of ``model`` shares; refuses blocks that differ."""
    from timm.models.eva import EvaBlock  # optional, as above
    from timm.models.vision_transformer import Block, ParallelScalingBlock  # optional, as above

    blocks = list(model.blocks)
    if not blocks:
        raise refuse("depth=0")
    read = []
    for block in blocks:
        if type(block) in (Block, EvaBlock):
            read.append(_sequential_block(block, width))
        elif type(block) is ParallelScalingBlock:
            read.append(_parallel_block(block, width))
        else:
            raise refuse("block_fn / use_post_norm", f"{type(block).__name__}")
    rates = [r.pop("drop_path") for r in read]
    if any(r != read[0] for r in read):
        raise refuse("per-block settings", "the blocks differ in their options")
    settings = read[0]
    if len(set(settings.pop("drops"))) > 1:
        raise refuse("proj_drop_rate", "different dropout rates inside one block")
    expected = [rates[-1] * i / max(len(blocks) - 1, 1) for i in range(len(blocks))]
    if any(abs(a - b) > 1e-6 for a, b in zip(rates, expected)):
        raise refuse("drop_path_rate", f"rates {rates} are not linear from 0")
    dropout = _rate(blocks[0].attn.proj_drop) if hasattr(blocks[0], "attn") else _rate(
        blocks[0].mlp_drop)  # fmt: skip
    return dict(settings, width=width, depth=len(blocks), drop_path=rates[-1], dropout=dropout)


# ---- the model around the blocks ---------------------------------------------------------------


def _patch_embed(m: nn.Module, dynamic: bool) -> dict:
    pe = m.patch_embed
    if not isinstance(getattr(pe, "proj", None), nn.Conv2d) or not isinstance(pe.norm, nn.Identity):
        raise refuse("embed_layer / embed_norm_layer", "only a plain patchify PatchEmbed")
    if getattr(pe, "dynamic_img_pad", False) or (not getattr(pe, "flatten", True) and not dynamic):
        raise refuse("dynamic_img_pad")
    (ph, pw), (ih, iw) = pe.patch_size, pe.img_size
    if ph != pw or ih != iw or pe.proj.kernel_size != pe.proj.stride:
        raise refuse("img_size / patch_size", "pycls needs square images and patches")
    return dict(image_size=ih, patch_size=ph, in_channels=pe.proj.in_channels)


def _attention_pool(pool: nn.Module, heads: int, mlp_dim: int) -> list:
    """Checks timm's AttentionPoolLatent against pycls's attention pool; its norm."""
    simple = (pool.latent_len == 1 and pool.pos_embed is None and isinstance(pool.q, nn.Linear)
              and pool.q.bias is not None and pool.kv.bias is not None and pool.pool == "token"
              and isinstance(pool.q_norm, nn.Identity) and pool.mlp is not None)  # fmt: skip
    if not simple:
        raise refuse("attn_pool", "pycls's pool has one latent query with biases, a norm and "
                     "an MLP")  # fmt: skip
    if pool.num_heads != heads or pool.mlp.fc1.out_features != mlp_dim:
        raise refuse("attn_pool_num_heads / attn_pool_mlp_ratio", "pycls's attention pool has "
                     "the blocks' heads and its MLP mlp_dim hidden units")  # fmt: skip
    if _rate(pool.proj_drop) or type(pool.mlp.act) is not nn.GELU:
        raise refuse("attn_pool", "an attention pool with dropout or another activation")
    return [_norm(pool.norm), _norm(pool.mlp.norm) if not isinstance(pool.mlp.norm, nn.Identity)
            else None]  # fmt: skip


def _head(m: nn.Module, args: dict) -> dict:
    """Pooling, the final norms and the classifier."""
    pool = {"token": "token", "avg": "pooled", "map": "map"}.get(m.global_pool)
    if pool is None:
        raise refuse(f"global_pool={m.global_pool!r}", "pycls has 'token', 'avg' and 'map'")
    if getattr(m, "pool_include_prefix", False):
        raise refuse("pool_include_prefix")
    norms = []
    if pool == "map":
        found = _attention_pool(m.attn_pool, args["num_heads"], args["mlp_dim"])
        if found[1] is not None:
            raise refuse("attn_pool", "a norm inside the pool's MLP")
        norms.append(found[0])
    elif getattr(m, "attn_pool", None) is not None:
        raise refuse("attention pooling with another global_pool")
    if _rate(m.head_drop):
        raise refuse("drop_rate", "dropout before the head")
    if isinstance(m.head, nn.Linear):
        num_classes = m.head.out_features
    elif isinstance(m.head, nn.Identity):
        num_classes = 0
    else:
        raise refuse("head", type(m.head).__name__)
    fc_norm = not isinstance(m.fc_norm, nn.Identity)
    if fc_norm == (not isinstance(m.norm, nn.Identity)):
        raise refuse("final_norm / fc_norm", "exactly one of norm and fc_norm must be used")
    norms.append(_norm(m.fc_norm if fc_norm else m.norm))
    return dict(classifier=pool, fc_norm=fc_norm, num_classes=num_classes, norms=norms)


def _norm_args(norms) -> dict:
    """norm_layer and norm_eps from every norm of the model; refuses a mix."""
    kinds, eps = {k for k, _ in norms if k is not None}, {e for _, e in norms}
    if len(eps) != 1:
        raise refuse("norm_layer", f"norms of different eps {sorted(eps)}")
    if len(kinds) != 1:
        raise refuse("norm_layer", "LayerNorm and RMSNorm in one model")
    return dict(norm_layer=kinds.pop(), norm_eps=eps.pop())


def _model_args(m: nn.Module, rope: dict, prefix_tokens: dict) -> dict:
    """VitArgs fields of a timm model ``m`` (VisionTransformer or Eva) with the RoPE's
    ``rope`` and its prefix tokens' ``prefix_tokens`` already read."""
    dynamic = bool(getattr(m, "dynamic_img_size", False))
    if dynamic and m.pos_embed is not None:
        raise refuse("dynamic_img_size", "with a learned position embedding")
    args = _patch_embed(m, dynamic)
    blocks = _blocks(m, m.patch_embed.proj.out_channels)
    if blocks.pop("rotate_half") != (rope.get("rope_layout") == "half"):
        raise refuse("rope_rotate_half", "the attention and the RoPE differ in their layout")
    head = _head(m, blocks)
    norms = blocks.pop("norms") + head.pop("norms")
    pre_norm = not isinstance(m.norm_pre, nn.Identity)
    if pre_norm:
        norms.append(_norm(m.norm_pre))
    if pre_norm != (m.patch_embed.proj.bias is None):
        raise refuse("pre_norm", "pycls ties pre_norm to a bias-free patch projection")
    if _rate(m.pos_drop) != blocks["dropout"]:
        raise refuse("pos_drop_rate", "pycls uses one rate for pos_drop and proj_drop")
    patch_drop = getattr(m, "patch_drop", None)
    if patch_drop is not None and not isinstance(patch_drop, nn.Identity):
        raise refuse("patch_drop_rate")
    pos_embed = "learned" if m.pos_embed is not None else "none"
    return dict(args, **blocks, **head, **_norm_args(norms), **rope, **prefix_tokens,
                pre_norm=pre_norm, pos_embed=pos_embed)  # fmt: skip


# ---- the RoPE of timm's Eva --------------------------------------------------------------------


def _rope(m: nn.Module, head_dim: int) -> dict:
    """rope, rope_temperature, rope_layout, rope_grid_indexing, rope_ref_grid of an Eva."""
    from timm.layers.pos_embed_sincos import (  # optional, as above
        RotaryEmbeddingCat,
        RotaryEmbeddingDinoV3,
        RotaryEmbeddingMixed,
    )

    r = m.rope
    if r is None:
        return {}
    if getattr(r, "aug_active", False):
        raise refuse("rope_shift_coords / rope_jitter_coords / rope_rescale_coords")
    if getattr(r, "grid_offset", 0.0):
        raise refuse("rope_grid_offset")
    kind = {RotaryEmbeddingCat: "axial", RotaryEmbeddingMixed: "mixed",
            RotaryEmbeddingDinoV3: "dinov3"}.get(type(r))  # fmt: skip
    if kind is None:
        raise refuse("rope_type", f"{type(r).__name__}; pycls has 'cat', 'mixed' and 'dinov3'")
    ref_grid = 0
    if kind == "axial":
        if r.in_pixels or r.grid_type != "index" or r.dim != head_dim:
            raise refuse("rope_type", "an axial RoPE on pixel coordinates")
        ref = r.ref_feat_shape
        if ref is not None and (len(set(ref)) != 1):
            raise refuse("ref_feat_shape", f"{ref}: pycls scales both axes alike")
        ref_grid = int(ref[0]) if ref is not None else 0
    if kind == "dinov3" and (r.min_period is not None or r.normalize_coords != "separate"):
        raise refuse("rope_type='dinov3'", "periods or coordinates other than timm's defaults")
    return dict(
        rope=kind,
        rope_temperature=float(r.temperature),
        rope_layout="half" if getattr(r, "rotate_half", False) else "interleaved",
        rope_grid_indexing=r.grid_indexing,
        rope_ref_grid=ref_grid,
    )


def timm_args(m: nn.Module) -> dict:
    """VitArgs fields of timm's VisionTransformer (or VisionTransformerDistilled) or Eva ``m``;
    ValueError naming the timm option pycls cannot express."""
    from timm.models.eva import Eva  # optional, as above

    width = m.patch_embed.proj.out_channels
    if isinstance(m, Eva):
        check_eva_prefix(m)
        registers = 0 if m.reg_token is None else m.reg_token.shape[1]
        tokens = dict(class_token=m.cls_token is not None, num_registers=registers)
        args = _model_args(m, _rope(m, width // m.blocks[0].attn.num_heads), tokens)
    else:
        tokens = dict(class_token=m.cls_token is not None, num_registers=m.num_reg_tokens)
        args = _model_args(m, {}, tokens)
        args["dist_token"] = getattr(m, "dist_token", None) is not None
        if args["dist_token"] and (args["fc_norm"] or m.num_reg_tokens):
            raise refuse("fc_norm / reg_tokens with the distillation token")
    if args["pos_embed"] == "none" and not args.get("rope"):
        args["rope"] = "none"
    return args


def check_eva_prefix(m: nn.Module) -> None:
    """Eva's attention skips its num_prefix_tokens when it rotates: they must be the model's."""
    for block in m.blocks:
        count = getattr(block.attn, "num_prefix_tokens", m.num_prefix_tokens)
        if count != m.num_prefix_tokens:
            raise refuse("num_prefix_tokens", "the attention rotates prefix tokens")
