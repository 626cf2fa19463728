"""The ViT's one argument list: ``VitArgs``, every argument of ``VisionTransformer``, each
declared once (``pycls.options.option``) with its default, what it means, what it may be
(``check``), whether it is counted or training-only, and its config key. The model is built from
it, its analytic complexity counts it (``pycls.models.vit.complexity``), the config's VIT keys are
generated from it (``pycls.config.sections.model_vit``) and checked by it, and the named variants
are presets of it (``VIT_SPECS``). Plain Python, no torch: the config checks a ViT's arguments
without it.
"""

import dataclasses
import inspect
import math
from dataclasses import dataclass

from pycls.options import Feature, Key, NoKey, ReadFrom, check_options, option, options_of

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


def _auto_is_sdpa(value):
    return "sdpa" if value == "auto" else value


def _class_token(token, classifier):
    return classifier == "token" or token


# Why the conv stem's keys hold a stem: the model's default has no conv stem, the key's default is
# Xiao et al.'s for patch 16 (read only with VIT.STEM_TYPE conv)
_C_STEM = (
    "the conv stem's keys, named as upstream pycls's (C_STEM_*); their defaults are the stem of "
    "Xiao et al. for patch 16, read only with VIT.STEM_TYPE conv"
)


@dataclass
class VitArgs:
    """Every argument of ``VisionTransformer`` (keyword arguments of the same names), each
    declared once (``pycls.options.option``): its default, what it means, its values, whether
    it is counted or training-only, and its config key (the VIT keys are generated from these
    fields: ``pycls.config.records``).

    The defaults are the original ViT's (ViT-B/16 at 224 px, 1000 classes, a class-token
    classifier, batch-first tokens), as torchvision's and timm's; the config keys have the same
    defaults but where a field's key says why not, and the recipes in configs/ ask for the pooled
    classifier (and batch-second tokens for small images).
    """

    image_size: int = option(
        224,
        "Square input side in pixels (a multiple of patch_size): the position embedding's grid. "
        "Another size resamples the table (set_image_size)",
        training_only=True,
        key=ReadFrom("TRAIN.IM_SIZE"),
    )
    patch_size: int = option(
        16,
        "Patch side in pixels (the stem's total stride); image sizes are multiples of it",
        bounds="positive",
    )
    in_channels: int = option(
        3,
        "Input channels",
        bounds="positive",
        key=NoKey("the data sets give RGB images; a model of other inputs is built in Python"),
    )
    num_classes: int = option(
        1000,
        "Outputs of the head (0: none, the model returns its features)",
        bounds="non_negative",
        key=ReadFrom("MODEL.NUM_CLASSES"),
    )
    depth: int = option(12, "Transformer blocks", bounds="positive")
    width: int = option(768, "Token width D (divisible by num_heads)", bounds="positive")
    num_heads: int = option(12, "Attention heads", bounds="positive")
    mlp_dim: int = option(
        3072,
        "Hidden width of the feed-forward network (4 x width in the standard variants)",
        bounds="positive",
    )
    stem: str = option(
        "patchify",
        "'patchify' (one patch_size x patch_size conv) or 'conv' (\"Early convolutions help "
        'transformers see better", Xiao et al. 2021: conv + BN + ReLU layers of '
        "conv_stem_channels / kernels / strides, the strides multiplying to patch_size, then a "
        "1x1 conv to the width)",
        choices=STEMS,
        key=Key("STEM_TYPE", why="upstream pycls's name"),
    )
    conv_stem_channels: tuple[int, ...] = option(
        (),
        "The conv stem's output channels, one per conv + BN + ReLU layer",
        key=Key("C_STEM_CHANNELS", default=[64, 128, 128, 256], why=_C_STEM),
    )
    conv_stem_kernels: tuple[int, ...] = option(
        (),
        "The conv stem's kernel sizes (odd: the padding keeps the grid)",
        key=Key("C_STEM_KERNELS", default=[3, 3, 3, 3], why=_C_STEM),
    )
    conv_stem_strides: tuple[int, ...] = option(
        (),
        "The conv stem's strides (their product is patch_size)",
        key=Key("C_STEM_STRIDES", default=[2, 2, 2, 2], why=_C_STEM),
    )
    classifier: str = option(
        "token",
        "'token' (a class token, read at position 0: the original ViT's) or 'pooled' (the mean of "
        "the patch tokens); the recipes in configs/ that train from scratch choose pooled",
        choices=CLASSIFIERS,
    )
    layout: str = option(
        "batch_first",
        "'batch_first' (N, L, D) or 'batch_second' (L, N, D), through the whole encoder; every "
        "ViT config in configs/ chooses one (batch_second for the small images of the quickstart "
        "and CIFAR)",
        choices=LAYOUTS,
        training_only=True,
        counted=False,
    )
    ffn: str = option(
        "mlp",
        "'mlp' (Linear-GELU-Linear) or 'local' (LocalViT: Linear, Hardswish, a 3x3 depthwise conv "
        "over the token grid, Hardswish, Linear)",
        choices=FFNS,
    )
    pos_embed: str = option(
        "learned",
        "'learned' (trunc-normal, std 0.02) or 'sincos' (a fixed 2-D sine-cosine table, a buffer)",
        choices=POS_EMBEDS,
    )
    dropout: float = option(
        0.0,
        "Dropout after the embedding and after the attention's and the feed-forward's projections",
        bounds="rate",
        training_only=True,
        counted=False,
    )
    attn_dropout: float = option(
        0.0,
        "Dropout on the attention weights",
        bounds="rate",
        training_only=True,
        counted=False,
    )
    drop_path: float = option(
        0.0,
        "Stochastic depth of the last block; the rates rise linearly from 0 at the first block",
        bounds="rate",
        training_only=True,
        counted=False,
    )
    norm_eps: float = option(1e-6, "LayerNorm epsilon", bounds="non_negative", counted=False)
    representation_size: int | None = option(
        None,
        "A Linear + Tanh of this width before the head (as torchvision's); None: none",
        bounds="positive",
        key=NoKey(
            "models imported with from_torchvision or from_timm carry it; no recipe trains one"
        ),  # fmt: skip
    )
    checkpoint_blocks: int = option(
        0,
        "Activation checkpointing: the first k blocks (at most depth) are recomputed in the "
        "backward pass, which saves their activations' memory",
        bounds="non_negative",
        training_only=True,
        counted=False,
    )
    class_token: bool | None = option(
        None,
        "Whether the sequence starts with a class token; None: with the token classifier only. "
        "True with the pooled classifier is the MAE/BEiT fine-tuning layout (the token takes part "
        "in attention, the head averages the patch tokens)",
        key=Key(
            default=False,
            also_reads=("VIT.CLASSIFIER",),
            read=_class_token,
            why="the key cannot hold None; False keeps no class token with the pooled "
            "classifier, and the token classifier always has one",
        ),
    )
    num_registers: int = option(
        0,
        'Learned register tokens after the class token ("Vision Transformers need registers"), '
        "left out of the pooled average",
        bounds="non_negative",
    )
    qkv_bias: bool = option(True, "A bias in the attention's qkv projection (False in some "
                            "pretrained models)")  # fmt: skip
    pre_norm: bool = option(
        False,
        "A LayerNorm (norm_pre) on the embedded tokens before the first block, and no bias in the "
        "patchify projection (CLIP, timm's pre_norm)",
    )
    fc_norm: bool = option(
        False,
        "Normalise after pooling (fc_norm) instead of before it (norm is then an identity), as "
        "timm's fc_norm (MAE and BEiT fine-tuning)",
        counted=False,
    )
    head_init_scale: float = option(
        0.0,
        "0 initialises the head to zero (torchvision); s > 0 draws its weight from a truncated "
        "normal with std 0.02 * s (timm's head_init_scale; BEiT and MAE fine-tune with 0.001)",
        bounds="non_negative",
        training_only=True,
        counted=False,
    )
    patch_drop: float = option(
        0.0,
        "Patch dropout while training (PatchDropout, FLIP; timm's patch_drop_rate): each image "
        "keeps a random 1 - patch_drop of its patch tokens after the position embedding (at least "
        "one), so the blocks run on fewer tokens; the class, distillation and register tokens "
        "stay, and evaluation sees every token. 0: off. set_patch_drop changes it between epochs",
        bounds="rate",
        training_only=True,
        counted=False,
        key=Key(owner="tokens"),
        feature="patch dropout",
    )
    drop_path_mode: str = option(
        "multiply",
        "How stochastic depth drops a sample's branch: 'multiply' (computed for every sample, the "
        "dropped ones multiplied by zero, as timm) or 'skip' (computed for the kept samples only: "
        "a random floor(n (1 - rate)) of a block's n samples, scaled by n / kept, as DINOv2; the "
        "same update in expectation, less work). In packed token batches a sample is a sequence",
        choices=DROP_PATH_MODES,
        training_only=True,
        counted=False,
        key=Key(owner="tokens"),
        feature=Feature(
            "drop-path skip", on=lambda a: a.drop_path_mode == "skip" and a.drop_path > 0
        ),
    )
    packed_attention: str = option(
        "sdpa",
        "How attention stays inside each image of a token batch (images of several grids, padded "
        "or packed into sequences): 'sdpa' (a boolean mask) or 'flex' (a FlexAttention block "
        "mask: the masked blocks are skipped once compiled; needs a torch that has it)",
        choices=PACKED_ATTENTIONS,
        training_only=True,
        counted=False,
        key=Key(
            owner="tokens",
            default="auto",
            choices=("auto", *PACKED_ATTENTIONS),
            read=_auto_is_sdpa,
            why="auto is flex on CUDA with TRAIN.COMPILE, sdpa otherwise, decided for the machine "
            "that runs (pycls.config.machine); a config read for elsewhere builds with sdpa, "
            "which every device runs",
        ),
    )
    dist_token: bool = option(
        False,
        "DeiT's distillation token, after the class token, read by a head of its own (head_dist) "
        "that DISTILL trains on the teacher's predictions; in set_distilled_training mode a "
        "training forward returns both heads' logits, otherwise (and always in eval mode) their "
        "mean. The layout of timm's VisionTransformerDistilled",
        feature="distillation token",
    )
    attention_backend: str = option(
        "default",
        "The kernel of the blocks' unmasked attention (scaled_dot_product_attention): 'default' "
        "(torch picks per call), or one pinned: 'cudnn', 'flash' (FlashAttention-2), 'efficient' "
        "(memory-efficient) or 'math'. cudnn, flash and efficient need CUDA (flash and cudnn "
        "half inputs: AMP.LEVEL O1-O3); a kernel that cannot take the shapes fails at the first "
        "step with torch's \"No available kernel\". A mask's attention (token batches) is torch's",
        choices=ATTENTION_BACKENDS,
        training_only=True,
        counted=False,
        feature="attention backend",
    )
    residual_dtype: str = option(
        "float32",
        "'float32' (no cast: the stream as autocast computes it) or 'bfloat16': under autocast, "
        "the embedded tokens (after the position embedding, patch dropout and norm_pre) are cast "
        "to bfloat16 before the first block, so every block adds its branches to a bfloat16 "
        "stream (as AMP O2 has it) while the weights stay as they are. The final norm reads the "
        "bfloat16 stream: CUDA's autocast runs LayerNorm in float32, so there pooling and the "
        "head see float32 features as before; the CPU's runs it in its input's dtype, so there "
        "they see bfloat16. Without autocast (an fp32 evaluation, an export) nothing is cast",
        choices=RESIDUAL_DTYPES,
        training_only=True,
        counted=False,
        key=ReadFrom("AMP.RESIDUAL_DTYPE"),
    )

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
        """Raises VitArgsError (naming the argument) unless the model can be built: each field's
        declared values and bounds, then what holds between fields."""
        check_options(self, VitArgsError)
        self._check_sizes()
        self._check_rates()
        self._check_tokens()
        return self

    def _check_sizes(self):
        check_image_size(self.image_size, self.patch_size)
        if self.width % self.num_heads != 0:
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
        if self.checkpoint_blocks > self.depth:
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
        if self.patch_drop > 0 and self.ffn == "local":
            raise VitArgsError(
                "patch_drop",
                "patch_drop needs every patch of the grid with ffn 'local' (its convolution runs "
                "over the whole grid); use ffn 'mlp'",
            )

    def _check_tokens(self):
        if self.dist_token and self.representation_size is not None:
            raise VitArgsError(
                "dist_token",
                "dist_token: DeiT's heads read the tokens, without representation_size",
            )
        if self.classifier == "token" and not self.class_token:
            raise VitArgsError("class_token", "classifier 'token' needs class_token=True (or None)")


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


# The arguments a checkpoint resumes under other values of, and those the complexity ignores
TRAINING_ONLY_ARGS = frozenset(n for n, (_, o) in options_of(VitArgs).items() if o.training_only)
UNCOUNTED = frozenset(n for n, (_, o) in options_of(VitArgs).items() if not o.counted)


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
