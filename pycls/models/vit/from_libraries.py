"""Vision Transformers of torchvision and timm rebuilt as pycls models with their weights:
``from_torchvision`` and ``from_timm`` read the other library's module into this one's
arguments, refusing what it cannot express."""

import torch
from torch import nn

from pycls.models.convert import timm_to_pycls, torchvision_to_pycls
from pycls.models.vit.blocks import place_rates
from pycls.models.vit.transformer import VisionTransformer

# ---- conversion from torchvision ------------------------------------------------------------


def _torchvision_conv_stem(conv_proj: nn.Sequential) -> tuple[dict, dict]:
    """Conv stem arguments and BatchNorm settings read from torchvision's ``conv_proj``."""
    channels, kernels, strides, bn_settings = [], [], [], {}
    for name, layer in conv_proj.named_children():
        if name == "conv_last":
            continue
        conv, bn = layer[0], layer[1]
        if not isinstance(bn, nn.BatchNorm2d) or not isinstance(layer[2], nn.ReLU):
            raise ValueError(f"conv stem layer {name} is not Conv2d + BatchNorm2d + ReLU")
        if conv.kernel_size[0] != conv.kernel_size[1] or conv.stride[0] != conv.stride[1]:
            raise ValueError(f"conv stem layer {name} has a non-square kernel or stride")
        channels.append(conv.out_channels)
        kernels.append(conv.kernel_size[0])
        strides.append(conv.stride[0])
        bn_settings[len(bn_settings)] = (bn.eps, bn.momentum)
    stem = dict(
        stem="conv",
        conv_stem_channels=tuple(channels),
        conv_stem_kernels=tuple(kernels),
        conv_stem_strides=tuple(strides),
    )
    return stem, bn_settings


def from_torchvision(tv_model: nn.Module, layout: str = "batch_first") -> VisionTransformer:
    """Build a pycls VisionTransformer with the weights of a torchvision VisionTransformer.

    Works for any ``torchvision.models.VisionTransformer`` (vit_b_16 ... vit_h_14, with or
    without ``representation_size`` and ``conv_stem_configs``). The result has a token
    classifier, the same sizes and dropout rates, and the requested ``layout``; it is placed on
    the device and dtype of ``tv_model`` and left in the same train/eval mode.
    """
    layers = list(tv_model.encoder.layers)
    first = layers[0]
    if not isinstance(tv_model.encoder.ln, nn.LayerNorm):
        raise ValueError("only LayerNorm-normalised torchvision ViTs can be converted")
    if isinstance(tv_model.conv_proj, nn.Conv2d):
        stem, bn_settings = {"stem": "patchify"}, {}
        in_channels = tv_model.conv_proj.in_channels
    else:
        stem, bn_settings = _torchvision_conv_stem(tv_model.conv_proj)
        in_channels = tv_model.conv_proj[0][0].in_channels
    # Built on the meta device and filled by assignment: random init of a ViT-H is seconds
    # of wasted work when every tensor is about to be replaced.
    with torch.device("meta"):
        model = VisionTransformer(
            image_size=tv_model.image_size,
            patch_size=tv_model.patch_size,
            in_channels=in_channels,
            num_classes=tv_model.num_classes,
            depth=len(layers),
            width=tv_model.hidden_dim,
            num_heads=first.num_heads,
            mlp_dim=tv_model.mlp_dim,
            classifier="token",
            layout=layout,
            ffn="mlp",
            pos_embed="learned",
            dropout=tv_model.dropout,
            attn_dropout=tv_model.attention_dropout,
            norm_eps=tv_model.encoder.ln.eps,
            representation_size=tv_model.representation_size,
            **stem,
        )
    for index, (eps, momentum) in bn_settings.items():
        bn = model.patch_embed.body[index].bn
        bn.eps, bn.momentum = eps, momentum
    # Cloned so the two models never share storage.

    state = torchvision_to_pycls({k: v.detach().clone() for k, v in tv_model.state_dict().items()})
    model.load_state_dict(state, strict=True, assign=True)
    place_rates(model, next(model.parameters()).device)
    return model.train(tv_model.training)


# ---- conversion from timm -------------------------------------------------------------------


def _timm_refuse(option: str, detail: str = "") -> ValueError:
    why = f" ({detail})" if detail else ""
    return ValueError(f"from_timm: timm option {option} is not supported by pycls{why}")


def _timm_layer_norm(norm: nn.Module, option: str) -> float:
    """eps of a LayerNorm with weight and bias; refuses anything else, naming ``option``."""
    if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
        raise _timm_refuse(option, f"got {type(norm).__name__}; pycls uses affine LayerNorm")
    return norm.eps


def _timm_rate(module: nn.Module) -> float:
    """Drop probability of an nn.Dropout or timm DropPath (0 for an identity)."""
    return float(getattr(module, "p", getattr(module, "drop_prob", 0.0)) or 0.0)


def _timm_block_args(timm_model: nn.Module) -> dict:
    """Per-block settings shared by every block of a timm ViT; refuses what pycls lacks."""
    # optional: timm is needed only to convert a timm model
    from timm.layers import Mlp
    from timm.models.vision_transformer import Attention, Block  # optional, as above

    blocks = list(timm_model.blocks)
    if not blocks:
        raise _timm_refuse("depth=0")
    settings = set()
    for block in blocks:
        if type(block) is not Block:
            raise _timm_refuse("block_fn", f"{type(block).__name__}; only timm's Block")
        if not (isinstance(block.ls1, nn.Identity) and isinstance(block.ls2, nn.Identity)):
            raise _timm_refuse("init_values", "LayerScale")
        attn, mlp = block.attn, block.mlp
        if type(attn) is not Attention:
            raise _timm_refuse("attn_layer", type(attn).__name__)
        if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
            raise _timm_refuse("qk_norm")
        if not isinstance(attn.norm, nn.Identity):
            raise _timm_refuse("scale_attn_norm")
        if getattr(attn, "gate", None) is not None:
            raise _timm_refuse("gated attention")
        if attn.proj.bias is None:
            raise _timm_refuse("proj_bias=False")
        if type(mlp) is not Mlp:
            raise _timm_refuse("mlp_layer", type(mlp).__name__)
        if not isinstance(mlp.norm, nn.Identity):
            raise _timm_refuse("scale_mlp_norm")
        if type(mlp.act) is not nn.GELU or mlp.act.approximate != "none":
            raise _timm_refuse("act_layer", f"{mlp.act}; pycls uses exact GELU")
        if mlp.fc1.bias is None or mlp.fc2.bias is None:
            raise _timm_refuse("proj_bias=False")
        width = attn.proj.out_features
        if attn.num_heads * attn.head_dim != width:
            raise _timm_refuse("head_dim / attn_dim", "attention width must equal embed_dim")
        eps = {
            _timm_layer_norm(block.norm1, "norm_layer"),
            _timm_layer_norm(block.norm2, "norm_layer"),
        }
        proj_drops = {_timm_rate(attn.proj_drop), _timm_rate(mlp.drop1), _timm_rate(mlp.drop2)}
        if len(proj_drops) != 1:
            raise _timm_refuse("proj_drop_rate", "different dropout rates inside one block")
        settings.add(
            (
                width,
                attn.num_heads,
                mlp.fc1.out_features,
                attn.qkv.bias is not None,
                *sorted(eps),
                proj_drops.pop(),
                _timm_rate(attn.attn_drop),
            )
        )
    if len(settings) != 1:
        raise _timm_refuse("per-block settings", "blocks differ in width, heads, eps or rates")
    width, heads, mlp_dim, qkv_bias, eps, *rest = settings.pop()
    if rest[:-2]:
        raise _timm_refuse("norm_layer", "two different LayerNorm eps in one block")
    dropout, attn_dropout = rest[-2:]
    # timm's drop-path rates rise linearly from 0 at the first block, as pycls's do
    rates = [_timm_rate(b.drop_path1) for b in blocks]
    drop_path = rates[-1]
    expected = [drop_path * i / max(len(blocks) - 1, 1) for i in range(len(blocks))]
    if any(abs(a - b) > 1e-6 for a, b in zip(rates, expected)):
        raise _timm_refuse("drop_path_rate", f"rates {rates} are not linear from 0")
    return dict(
        depth=len(blocks),
        width=width,
        num_heads=heads,
        mlp_dim=mlp_dim,
        qkv_bias=qkv_bias,
        norm_eps=eps,
        dropout=dropout,
        attn_dropout=attn_dropout,
        drop_path=drop_path,
    )


def _timm_model_args(timm_model: nn.Module) -> dict:
    """VisionTransformer arguments for a timm VisionTransformer; refuses what pycls lacks."""
    m = timm_model
    if m.global_pool not in ("token", "avg"):
        raise _timm_refuse(f"global_pool={m.global_pool!r}", "pycls has 'token' and 'avg'")
    if getattr(m, "attn_pool", None) is not None or getattr(m, "pool_include_prefix", False):
        raise _timm_refuse("pool_include_prefix / attention pooling")
    if getattr(m, "dynamic_img_size", False):
        raise _timm_refuse("dynamic_img_size")
    if m.pos_embed is None:
        raise _timm_refuse("pos_embed='none'")
    if not isinstance(m.patch_drop, nn.Identity):
        raise _timm_refuse("patch_drop_rate")
    if _timm_rate(m.head_drop):
        raise _timm_refuse("drop_rate", "dropout before the head")
    if not isinstance(m.head, nn.Linear):
        raise _timm_refuse("num_classes=0", "pycls models have a classifier head")
    pe = m.patch_embed
    if not isinstance(getattr(pe, "proj", None), nn.Conv2d) or not isinstance(pe.norm, nn.Identity):
        raise _timm_refuse("embed_layer / embed_norm_layer", "only a plain patchify PatchEmbed")
    if getattr(pe, "dynamic_img_pad", False) or not getattr(pe, "flatten", True):
        raise _timm_refuse("dynamic_img_pad")
    (ph, pw), (ih, iw) = pe.patch_size, pe.img_size
    if ph != pw or ih != iw or pe.proj.kernel_size != pe.proj.stride:
        raise _timm_refuse("img_size / patch_size", "pycls needs square images and patches")
    pre_norm = not isinstance(m.norm_pre, nn.Identity)
    if pre_norm:
        _timm_layer_norm(m.norm_pre, "norm_layer")
    if pre_norm != (pe.proj.bias is None):
        raise _timm_refuse("pre_norm", "pycls ties pre_norm to a bias-free patch projection")
    fc_norm = not isinstance(m.fc_norm, nn.Identity)
    if fc_norm == (not isinstance(m.norm, nn.Identity)):
        raise _timm_refuse("final_norm / fc_norm", "exactly one of norm and fc_norm must be used")
    args = _timm_block_args(m)
    dist_token = getattr(m, "dist_token", None) is not None  # VisionTransformerDistilled
    if dist_token and (fc_norm or m.num_reg_tokens):
        raise _timm_refuse("fc_norm / reg_tokens with the distillation token")
    if _timm_layer_norm(m.fc_norm if fc_norm else m.norm, "norm_layer") != args["norm_eps"]:
        raise _timm_refuse("norm_layer", "the final norm's eps differs from the blocks'")
    if _timm_rate(m.pos_drop) != args["dropout"]:
        raise _timm_refuse("pos_drop_rate", "pycls uses one rate for pos_drop and proj_drop")
    return dict(
        image_size=ih,
        patch_size=ph,
        in_channels=pe.proj.in_channels,
        num_classes=m.head.out_features,
        classifier="token" if m.global_pool == "token" else "pooled",
        class_token=m.cls_token is not None,
        num_registers=m.num_reg_tokens,
        pre_norm=pre_norm,
        fc_norm=fc_norm,
        dist_token=dist_token,
        **args,
    )


def from_timm(timm_model: nn.Module, layout: str = "batch_first") -> VisionTransformer:
    """Build a pycls VisionTransformer with the weights of a timm ``VisionTransformer``.

    Covers timm's ViT family as pycls can represent it exactly: class-token or average pooling
    (``global_pool`` 'token' / 'avg'), with or without ``fc_norm``, ``class_token`` on or off,
    ``reg_tokens``, ``no_embed_class`` (pycls gets zero position rows for the prefix tokens,
    the same sums), ``pre_norm``, ``qkv_bias`` on or off, any patch size, depth and width, and
    DeiT's distilled models (``VisionTransformerDistilled``: the distillation token and head).
    Anything else (LayerScale ``init_values``, ``qk_norm``, other pooling, activation or norm
    layers, ...) raises ValueError naming the timm option. The result has the requested
    ``layout``, is on ``timm_model``'s device and dtype and in its train/eval mode.
    """
    from timm.models.vision_transformer import VisionTransformer as TimmViT  # optional: timm

    if not isinstance(timm_model, TimmViT):
        raise TypeError(
            f"from_timm needs a timm VisionTransformer, got {type(timm_model).__name__}"
        )
    args = _timm_model_args(timm_model)
    with torch.device("meta"):
        model = VisionTransformer(layout=layout, **args)
    state = {k: v.detach().clone() for k, v in timm_model.state_dict().items()}
    model.load_state_dict(timm_to_pycls(state), strict=True, assign=True)
    place_rates(model, next(model.parameters()).device)
    return model.train(timm_model.training)
