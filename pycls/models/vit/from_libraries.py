"""Vision Transformers of torchvision and timm rebuilt as pycls models with their weights:
``from_torchvision`` and ``from_timm`` read the other library's module into this one's
arguments (timm's: ``timm_import``), refusing what it cannot express."""

import torch
from torch import nn

from pycls.models.convert import timm_to_pycls, torchvision_to_pycls
from pycls.models.vit.blocks import place_rates
from pycls.models.vit.timm_import import timm_args
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


def from_timm(timm_model: nn.Module, layout: str = "batch_first") -> VisionTransformer:
    """Build a pycls VisionTransformer with the weights of a timm ``VisionTransformer`` or ``Eva``.

    Covers timm's ViT family as pycls can represent it exactly (``pycls.models.vit.timm_import``
    reads it): class-token, average or attention-pool pooling (``global_pool`` 'token', 'avg',
    'map'), with or without ``fc_norm``, ``class_token`` on or off, ``reg_tokens``,
    ``no_embed_class`` (pycls gets zero position rows for the prefix tokens, the same sums),
    ``pos_embed='none'``, ``pre_norm``, ``qkv_bias`` and ``proj_bias`` on or off, ``init_values``
    (LayerScale), ``qk_norm``, LayerNorm or RMSNorm (``norm_layer``), the GELU ``Mlp``,
    ``SwiGLUPacked`` and ``SwiGLU`` with or without ``scale_mlp_norm``, ``ParallelScalingBlock``,
    ``num_classes=0`` (features), any patch size, depth and width, and DeiT's distilled models
    (``VisionTransformerDistilled``). Of ``Eva`` (EVA-02, DINOv3, the RoPE ViTs): its attention
    (q and v biases without a k bias, fused or separate q, k, v, or the RoPE attention's full
    bias), its LayerScale, SwiGLU and MLP norm, and its RoPE ('cat', 'mixed', 'dinov3'), with or
    without an absolute position embedding (without one, ``dynamic_img_size`` too: pycls's
    positions follow each input's grid). Anything else raises ValueError naming the timm option.
    The result has the requested ``layout``, is on ``timm_model``'s device and dtype and in its
    train/eval mode.
    """
    from timm.models.eva import Eva  # optional: timm
    from timm.models.vision_transformer import VisionTransformer as TimmViT  # optional, as above

    if not isinstance(timm_model, TimmViT | Eva):
        raise TypeError(
            f"from_timm needs a timm VisionTransformer or Eva, got {type(timm_model).__name__}"
        )
    args = timm_args(timm_model)
    with torch.device("meta"):
        model = VisionTransformer(layout=layout, **args)
    state = {k: v.detach().clone() for k, v in timm_model.state_dict().items()}
    no_embed_class = bool(getattr(timm_model, "no_embed_class", False))
    model.load_state_dict(timm_to_pycls(state, no_embed_class), strict=True, assign=True)
    place_rates(model, next(model.parameters()).device)
    return model.train(timm_model.training)
