"""The ViT's one argument list: ``VitArgs``, every argument of ``VisionTransformer`` with its
default, what it means and what it may be (``check``). The model is built from it, its analytic
complexity counts it (``pycls.models.vit.complexity``), the config's VIT keys are translated into
it (``pycls.config.sections.model_vit``) and checked by it, and the named variants are presets of
it (``VIT_SPECS``). Plain Python, no torch: the config checks a ViT's arguments without it.
"""

import dataclasses
import inspect
import math
from dataclasses import dataclass, field

STEMS = ("patchify", "conv")
CLASSIFIERS = ("token", "pooled")
LAYOUTS = ("batch_first", "batch_second")
FFNS = ("mlp", "local")
POS_EMBEDS = ("learned", "sincos")
# How stochastic depth drops a sample's branch: computed and multiplied by zero, or skipped:
# not computed at all
DROP_PATH_MODES = ("multiply", "skip")
# How attention is kept inside each image of a token batch
PACKED_ATTENTIONS = ("sdpa", "flex")
# The kernels of scaled_dot_product_attention the blocks' unmasked attention may be pinned to
# (``blocks.SDPA_BACKENDS``): "default" lets torch pick for each call; cudnn, flash and efficient
# run on CUDA only, and cudnn and flash take half inputs only (math runs anywhere)
ATTENTION_BACKENDS = ("default", "cudnn", "flash", "efficient", "math")
CUDA_ATTENTION = ("cudnn", "flash", "efficient")
HALF_ATTENTION = ("cudnn", "flash")
# The residual stream's dtype under autocast (``transformer.VisionTransformer.to_residual``)
RESIDUAL_DTYPES = ("float32", "bfloat16")

# The sizes of the named variants (pycls.models.vit.variants): "An image is worth 16x16 words"
# (B, L, H), DeiT (Ti, S), "Scaling Vision Transformers" (g/14, G/14) and ViT-22B's shape
VIT_SPECS: dict[str, dict[str, int]] = {
    "vit_ti16": dict(patch_size=16, width=192, depth=12, num_heads=3, mlp_dim=768),
    "vit_s16": dict(patch_size=16, width=384, depth=12, num_heads=6, mlp_dim=1536),
    "vit_b16": dict(patch_size=16, width=768, depth=12, num_heads=12, mlp_dim=3072),
    "vit_b32": dict(patch_size=32, width=768, depth=12, num_heads=12, mlp_dim=3072),
    "vit_l16": dict(patch_size=16, width=1024, depth=24, num_heads=16, mlp_dim=4096),
    "vit_h16": dict(patch_size=16, width=1280, depth=32, num_heads=16, mlp_dim=5120),
    "vit_h14": dict(patch_size=14, width=1280, depth=32, num_heads=16, mlp_dim=5120),
    "vit_g14": dict(patch_size=14, width=1408, depth=40, num_heads=16, mlp_dim=6144),
    "vit_bigg14": dict(patch_size=14, width=1664, depth=48, num_heads=16, mlp_dim=8192),
    "vit_22b14": dict(patch_size=14, width=6144, depth=48, num_heads=48, mlp_dim=24576),
}


class VitArgsError(ValueError):
    """An argument the ViT cannot be built with; ``arg`` names it."""

    def __init__(self, arg, message):
        super().__init__(message)
        self.arg = arg


def _arg(default, *, training_only=False, counted=True):
    """A field: ``training_only`` arguments leave the parameters (names, shapes, what they compute)
    as they are, so a checkpoint resumes under other values; ``counted`` ones change the analytic
    complexity."""
    return field(default=default, metadata={"training_only": training_only, "counted": counted})


@dataclass
class VitArgs:
    """Every argument of ``VisionTransformer`` (keyword arguments of the same names).

    The defaults are the original ViT's (ViT-B/16 at 224 px, 1000 classes, a class-token
    classifier, batch-first tokens), as torchvision's and timm's; the config tree has the same
    defaults, and the recipes in configs/ ask for the pooled classifier (and batch-second tokens
    for small images).
    """

    # Square input side in pixels (a multiple of patch_size); the position embedding's grid.
    # Another size resamples the table (set_image_size)
    image_size: int = _arg(224, training_only=True)
    # Patch side in pixels (the stem's total stride)
    patch_size: int = _arg(16)
    # Input channels
    in_channels: int = _arg(3)
    # Outputs of the head (0: none, the model returns its features)
    num_classes: int = _arg(1000)
    # Transformer blocks
    depth: int = _arg(12)
    # Token width D (divisible by num_heads)
    width: int = _arg(768)
    # Attention heads
    num_heads: int = _arg(12)
    # Hidden width of the feed-forward network
    mlp_dim: int = _arg(3072)
    # "patchify" (one patch_size x patch_size conv) or "conv" (Xiao et al. 2021: conv + BN + ReLU
    # layers of conv_stem_channels / kernels / strides, the strides multiplying to patch_size,
    # then a 1x1 conv to D)
    stem: str = _arg("patchify")
    conv_stem_channels: tuple[int, ...] = _arg(())
    conv_stem_kernels: tuple[int, ...] = _arg(())
    conv_stem_strides: tuple[int, ...] = _arg(())
    # "token" (a class token, read at position 0; the original ViT's) or "pooled" (the mean of the
    # patch tokens)
    classifier: str = _arg("token")
    # "batch_first" (N, L, D) or "batch_second" (L, N, D), through the whole encoder
    layout: str = _arg("batch_first", training_only=True, counted=False)
    # "mlp" (Linear-GELU-Linear) or "local" (LocalViT: Linear-Hardswish-depthwise 3x3 conv over
    # the grid-Hardswish-Linear)
    ffn: str = _arg("mlp")
    # "learned" (trunc-normal, std 0.02) or "sincos" (a fixed 2-D table, a buffer)
    pos_embed: str = _arg("learned")
    # Dropout after the embedding and the projections, and on the attention weights
    dropout: float = _arg(0.0, training_only=True, counted=False)
    attn_dropout: float = _arg(0.0, training_only=True, counted=False)
    # Stochastic depth of the last block; the rates rise linearly from 0 at the first block
    drop_path: float = _arg(0.0, training_only=True, counted=False)
    # LayerNorm epsilon
    norm_eps: float = _arg(1e-6, counted=False)
    # A Linear + Tanh before the head of this width (as torchvision's); None: none
    representation_size: int | None = _arg(None)
    # Recompute the first k blocks in the backward pass (activation checkpointing), training only
    checkpoint_blocks: int = _arg(0, training_only=True, counted=False)
    # Whether the sequence starts with a class token; None: with the token classifier only. True
    # with the pooled classifier is the MAE/BEiT fine-tuning layout (the token takes part in
    # attention, the head averages the patch tokens)
    class_token: bool | None = _arg(None)
    # Learned register tokens after the class token ("Vision Transformers need registers"), left
    # out of the pooled average
    num_registers: int = _arg(0)
    # Bias in the qkv projection
    qkv_bias: bool = _arg(True)
    # A LayerNorm (norm_pre) on the embedded tokens before the first block, and no bias in the
    # patchify projection (CLIP, timm's pre_norm)
    pre_norm: bool = _arg(False)
    # Normalise after pooling (fc_norm) instead of before it (norm is then an identity), as
    # timm's fc_norm
    fc_norm: bool = _arg(False, counted=False)
    # 0 initialises the head to zero (torchvision); s > 0 draws its weight from a truncated
    # normal with std 0.02 * s (timm's head_init_scale; BEiT and MAE fine-tune with 0.001)
    head_init_scale: float = _arg(0.0, training_only=True, counted=False)
    # Patch dropout while training: the fraction of each image's patch tokens dropped after the
    # position embedding (timm's patch_drop_rate; 0: off); the class, distillation and register
    # tokens stay, evaluation sees every token. set_patch_drop changes it between epochs
    patch_drop: float = _arg(0.0, training_only=True, counted=False)
    # "multiply" (the dropped samples' branch computed and multiplied by zero) or "skip"
    # (computed for the kept samples only; token_masks.skip_residual)
    drop_path_mode: str = _arg("multiply", training_only=True, counted=False)
    # How attention stays inside each image of a TokenBatch (images of several grids, padded or
    # packed into sequences): "sdpa" (a boolean mask) or "flex" (a FlexAttention block mask,
    # which skips the masked blocks once compiled)
    packed_attention: str = _arg("sdpa", training_only=True, counted=False)
    # DeiT's distillation token, after the class token, read by a head of its own (head_dist);
    # in set_distilled_training mode a training forward returns both heads' logits, otherwise
    # (and always in eval mode) their mean. timm's VisionTransformerDistilled layout
    dist_token: bool = _arg(False)
    # The kernel of the blocks' unmasked attention: "default" (torch picks per call), "cudnn",
    # "flash", "efficient" or "math" (``blocks.SDPA_BACKENDS``); a mask's attention is torch's
    attention_backend: str = _arg("default", training_only=True, counted=False)
    # "float32" (no cast: the stream as autocast computes it) or "bfloat16": under autocast, the
    # embedded tokens (after the position embedding, patch dropout and norm_pre) are cast to
    # bfloat16 before the first block, so every block adds its branches to a bfloat16 stream (as
    # AMP O2 has it) while the weights stay as they are. The final norm reads the bfloat16
    # stream: CUDA's autocast runs LayerNorm in float32, so there pooling and the head see
    # float32 features as before; the CPU's runs it in its input's dtype, so there they see
    # bfloat16. Without autocast (an fp32 evaluation, an export) nothing is cast
    residual_dtype: str = _arg("float32", training_only=True, counted=False)

    def __post_init__(self):
        self.conv_stem_channels = tuple(self.conv_stem_channels)
        self.conv_stem_kernels = tuple(self.conv_stem_kernels)
        self.conv_stem_strides = tuple(self.conv_stem_strides)
        if self.class_token is None:
            self.class_token = self.classifier == "token"
        self.class_token = bool(self.class_token)

    @classmethod
    def of(cls, args=None, **kwargs):
        """``args`` (a VitArgs, or a mapping of arguments) with ``kwargs`` over it."""
        if args is None:
            return cls(**kwargs)
        if isinstance(args, cls):
            return dataclasses.replace(args, **kwargs)  # a copy: the caller's record stays
        return cls(**{**args, **kwargs})

    def as_dict(self):
        return dataclasses.asdict(self)

    @property
    def num_prefix_tokens(self):
        """Class, distillation and register tokens before the patches."""
        return int(self.class_token) + int(self.dist_token) + self.num_registers

    def check(self):
        """Raises VitArgsError (naming the argument) unless the model can be built."""
        for name, allowed in (
            ("stem", STEMS),
            ("classifier", CLASSIFIERS),
            ("layout", LAYOUTS),
            ("ffn", FFNS),
            ("pos_embed", POS_EMBEDS),
            ("drop_path_mode", DROP_PATH_MODES),
            ("packed_attention", PACKED_ATTENTIONS),
            ("attention_backend", ATTENTION_BACKENDS),
            ("residual_dtype", RESIDUAL_DTYPES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                options = ", ".join(repr(a) for a in allowed)
                raise VitArgsError(name, f"unknown {name} {value!r}; expected one of: {options}")
        self._check_sizes()
        self._check_rates()
        self._check_tokens()
        return self

    def _check_sizes(self):
        if self.patch_size <= 0:
            raise VitArgsError("patch_size", f"patch_size must be positive, got {self.patch_size}")
        check_image_size(self.image_size, self.patch_size)
        if self.num_heads <= 0 or self.width % self.num_heads != 0:
            raise VitArgsError(
                "width", f"width {self.width} must be divisible by num_heads {self.num_heads}"
            )
        if self.pos_embed == "sincos" and self.width % 4 != 0:
            raise VitArgsError(
                "pos_embed",
                f"pos_embed 'sincos' needs width divisible by 4, got width {self.width}",
            )
        if self.stem == "conv":
            self._check_conv_stem()
        size = self.representation_size
        if size is not None and size <= 0:
            raise VitArgsError(
                "representation_size", f"representation_size must be positive or None, got {size}"
            )
        if not 0 <= self.checkpoint_blocks <= self.depth:
            raise VitArgsError(
                "checkpoint_blocks",
                f"checkpoint_blocks must be in [0, depth={self.depth}], got "
                f"{self.checkpoint_blocks}",
            )

    def _check_conv_stem(self):
        channels, kernels, strides = (
            self.conv_stem_channels,
            self.conv_stem_kernels,
            self.conv_stem_strides,
        )
        if not channels or not len(channels) == len(kernels) == len(strides):
            raise VitArgsError(
                "conv_stem_channels",
                "stem 'conv' needs conv_stem_channels, conv_stem_kernels and conv_stem_strides of "
                f"the same non-zero length, got {channels}, {kernels}, {strides}",
            )
        if any(k % 2 == 0 or k <= 0 for k in kernels):
            # Odd kernels with padding (k - 1) // 2 are what keep the grid at image_size / patch
            raise VitArgsError("conv_stem_kernels", f"conv_stem_kernels must be odd, got {kernels}")
        if math.prod(strides) != self.patch_size:
            raise VitArgsError(
                "conv_stem_strides",
                f"product of conv_stem_strides {strides} is {math.prod(strides)}, "
                f"but must equal patch_size {self.patch_size}",
            )

    def _check_rates(self):
        for name in ("dropout", "attn_dropout", "drop_path", "patch_drop"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise VitArgsError(name, f"{name} must be in [0, 1), got {rate}")
        if self.patch_drop > 0 and self.ffn == "local":
            raise VitArgsError(
                "patch_drop",
                "patch_drop needs every patch of the grid with ffn 'local' (its convolution runs "
                "over the whole grid); use ffn 'mlp'",
            )
        if self.head_init_scale < 0:
            raise VitArgsError(
                "head_init_scale", f"head_init_scale must be >= 0, got {self.head_init_scale}"
            )

    def _check_tokens(self):
        if self.dist_token and self.representation_size is not None:
            raise VitArgsError(
                "dist_token",
                "dist_token: DeiT's heads read the tokens, without representation_size",
            )
        if self.classifier == "token" and not self.class_token:
            raise VitArgsError("class_token", "classifier 'token' needs class_token=True (or None)")
        if self.num_registers < 0:
            raise VitArgsError(
                "num_registers", f"num_registers must be >= 0, got {self.num_registers}"
            )


def check_image_size(image_size: int, patch_size: int) -> None:
    if image_size <= 0 or image_size % patch_size != 0:
        raise VitArgsError(
            "image_size",
            f"image_size {image_size} must be a positive multiple of patch_size {patch_size}",
        )


def keyword_signature():
    """``(args=None, /, *, image_size=224, ...)``: the signature of whatever takes a VitArgs or its
    fields as keyword arguments (the model, its complexity), as ``help()`` and editors show it."""
    first = inspect.Parameter("args", inspect.Parameter.POSITIONAL_ONLY, default=None)
    fields = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in dataclasses.fields(VitArgs)
    ]
    return inspect.Signature([first, *fields])


def _fields_where(key):
    return frozenset(f.name for f in dataclasses.fields(VitArgs) if f.metadata[key])


# The arguments a checkpoint resumes under other values of, and those the complexity ignores
TRAINING_ONLY_ARGS = _fields_where("training_only")
UNCOUNTED = frozenset(f.name for f in dataclasses.fields(VitArgs)) - _fields_where("counted")


# ------------------------------------------------------------------------------------------------ #
# How many processes can split the heads and the MLP (tensor parallelism: models/vit/tensor_plan)
# ------------------------------------------------------------------------------------------------ #


def tp_divisors(n, limit=None):
    """The tensor-parallel degrees that divide ``n`` (heads, MLP width), up to ``limit``."""
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def check_vit_split(num_heads, mlp_dim, tp):
    """Raises ValueError unless ``tp`` processes can split the heads and the hidden width."""
    for what, n in (("num_heads", num_heads), ("mlp_dim", mlp_dim)):
        if n % tp:
            raise ValueError(
                f"{what} {n} is not divisible by the {tp} tensor-parallel processes; "
                f"degrees that divide it: {tp_divisors(n, max(tp, 8))}"
            )
