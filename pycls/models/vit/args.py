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
from dataclasses import dataclass

# VitArgsError and check_image_size are also imported from here (the model, the config)
from pycls.models.vit.arg_checks import (  # noqa: F401
    VitArgsError,
    check_between_fields,
    check_image_size,
)
from pycls.options import Feature, Key, NoKey, ReadFrom, check_options, option, options_of

STEMS = ("patchify", "conv")
CLASSIFIERS = ("token", "pooled", "map")
LAYOUTS = ("batch_first", "batch_second")
FFNS = ("mlp", "local", "swiglu", "swiglu_packed")
# The feed-forward's hidden width: mlp_dim as given, or two thirds of it (a SwiGLU with about the
# parameters and FLOPs of a GELU MLP of width mlp_dim: timm's mlp_ratio 4 * 2 / 3)
FFN_WIDTHS = ("mlp_dim", "two_thirds")
POS_EMBEDS = ("learned", "sincos", "none")
# The norm layers (VitArgs.norm_layer) and the norm of each head's queries and keys (qk_norm)
NORM_LAYERS = ("layer", "rms")
QK_NORMS = ("none", "layer", "rms")
# Sequential blocks (attention, then the feed-forward) or parallel ones (both from one norm,
# "Scaling Vision Transformers to 22 Billion Parameters")
BLOCKS = ("sequential", "parallel")
# 2-D rotary position embedding (pycls.models.vit.rotary)
ROPES = ("none", "axial", "mixed", "dinov3")
ROPE_LAYOUTS = ("interleaved", "half")
ROPE_GRID_INDEXINGS = ("ij", "xy")
# How stochastic depth drops a sample's branch: computed and multiplied by zero, or skipped:
# not computed at all
DROP_PATH_MODES = ("multiply", "skip")
# How the stochastic-depth rate varies over the blocks: rising linearly from 0 at the first block to
# drop_path at the last (stochastic depth's rule, timm's), or drop_path at every block (DeiT III's
# models_v2.py, dpr_constant)
DROP_PATH_SCHEDULES = ("linear", "uniform")
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

# The named variants (pycls.models.vit.variants), their sizes and options: "An image is worth
# 16x16 words" (B, L, H), DeiT (Ti, S), "Scaling Vision Transformers" (g/14, G/14), ViT-22B's
# shape, and DeiT III ("DeiT III: Revenge of the ViT", Touvron et al. 2022: LayerScale at 1e-6, as
# timm 1.0.31's deit3_* of timm/models/deit.py)
VIT_SPECS: dict[str, dict[str, int | float]] = {
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
    "deit3_s16": dict(patch_size=16, width=384, depth=12, num_heads=6, mlp_dim=1536,
                      layer_scale_init=1e-6),
    "deit3_b16": dict(patch_size=16, width=768, depth=12, num_heads=12, mlp_dim=3072,
                      layer_scale_init=1e-6),
    "deit3_l16": dict(patch_size=16, width=1024, depth=24, num_heads=16, mlp_dim=4096,
                      layer_scale_init=1e-6),
    "deit3_h14": dict(patch_size=14, width=1280, depth=32, num_heads=16, mlp_dim=5120,
                      layer_scale_init=1e-6),
}  # fmt: skip


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
        "Outputs of the head (0: none, an identity: the model returns its pooled features, of the "
        "width or representation_size, as timm's num_classes=0)",
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
        "'token' (a class token, read at position 0: the original ViT's), 'pooled' (the mean of "
        "the patch tokens) or 'map' (multihead attention pooling: a learned probe attends over "
        "every token, then an MLP with a residual, as SigLIP and timm's global_pool='map'); the "
        "recipes in configs/ that train from scratch choose pooled",
        choices=CLASSIFIERS,
        feature=Feature("MAP head", on=lambda a: a.classifier == "map"),
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
    block: str = option(
        "sequential",
        "'sequential' (attention, then the feed-forward, each after a norm of its own) or "
        "'parallel' (both read one norm of the block's input and add into the residual together, "
        "their input projections one matrix, in_proj, and their output projections one, out_proj: "
        "ViT-22B's block, timm's ParallelScalingBlock; with ffn 'mlp')",
        choices=BLOCKS,
        feature="parallel blocks",
    )
    ffn: str = option(
        "mlp",
        "'mlp' (Linear-GELU-Linear), 'local' (LocalViT: Linear, Hardswish, a 3x3 depthwise conv "
        "over the token grid, Hardswish, Linear), 'swiglu' (SiLU(fc1_g x) * fc1_x x, then fc2: "
        "two input projections, as timm's SwiGLU and EVA-02) or 'swiglu_packed' (the same with "
        "one input projection fc1 whose first half is the gate, as timm's SwiGLUPacked and "
        "DINOv2-giant)",
        choices=FFNS,
        feature=Feature("SwiGLU", on=lambda a: a.ffn.startswith("swiglu")),
    )
    ffn_width: str = option(
        "mlp_dim",
        "The feed-forward's hidden width: 'mlp_dim' (as given) or 'two_thirds' (mlp_dim * 2 // 3: "
        "a SwiGLU of about the parameters and FLOPs of a GELU MLP of width mlp_dim, timm's "
        "mlp_ratio 4 * 2 / 3; ViT-B's 3072 gives 2048)",
        choices=FFN_WIDTHS,
    )
    ffn_align: int = option(
        0,
        "Rounds the feed-forward's hidden width (after ffn_width) up to a multiple of this, as "
        "DINOv3 aligns its SwiGLU to 8 or 64 (whole tiles keep the matrix products on fast "
        "kernels); 0: as it is",
        bounds="non_negative",
    )
    ffn_norm: bool = option(
        False,
        "A norm (norm_layer) over the feed-forward's hidden activations before its output "
        "projection: EVA-02's sub-LN (timm's scale_mlp_norm)",
        feature="FFN norm",
    )
    pos_embed: str = option(
        "learned",
        "'learned' (trunc-normal, std 0.02), 'sincos' (a fixed 2-D sine-cosine table, a buffer) or "
        "'none' (no absolute position embedding: with rope, the positions enter the attention "
        "only, as DINOv3 and RoPE-ViT)",
        choices=POS_EMBEDS,
    )
    rope: str = option(
        "none",
        "2-D rotary position embedding of each head's queries and keys, at every block: 'axial' "
        "(half of a head's rotated pairs turn with the row, half with the column, at fixed "
        "frequencies: EVA-02, RoPE-ViT), 'mixed' (each head of each block learns its frequencies "
        "along both axes: RoPE-Mixed, Heo et al. 2024) or 'dinov3' (axial, on coordinates "
        "normalised to [-1, 1] along each axis: DINOv3). The class, distillation and register "
        "tokens are not rotated; positions follow each image's own grid (patch dropout, token "
        "batches, other image sizes). Needs a head width divisible by 4; 'none'",
        choices=ROPES,
        feature="RoPE",
    )
    rope_temperature: float = option(
        10000.0,
        "The RoPE's frequency base: of the d / 4 pairs per axis of a head of width d, pair k "
        "turns temperature ** (-k / (d/4)) radians per patch ('axial'), has the period "
        "temperature ** (k / (d/4)) in units of half the image ('dinov3'), or starts at that "
        "magnitude ('mixed'). EVA-02 10000, RoPE-ViT 100, RoPE-Mixed 10, DINOv3 100",
        bounds="positive",
        counted=False,
    )
    rope_layout: str = option(
        "interleaved",
        "Which of a head's channels the RoPE turns together: 'interleaved' (0 with 1, 2 with 3, "
        "...: EVA-02, RoPE-ViT) or 'half' (i with i + d/2: DINOv3, timm's rope_rotate_half)",
        choices=ROPE_LAYOUTS,
        counted=False,
    )
    rope_grid_indexing: str = option(
        "ij",
        "The order of the RoPE's axes: 'ij' (row, then column: the first frequencies turn with "
        "the row) or 'xy' (column, then row: RoPE-ViT's and RoPE-Mixed's)",
        choices=ROPE_GRID_INDEXINGS,
        counted=False,
    )
    rope_ref_grid: int = option(
        0,
        "With rope 'axial': positions scaled so that every grid spans this many patches per side "
        "(EVA-02 at another image size, timm's ref_feat_shape); 0: positions are patch indices",
        bounds="non_negative",
        counted=False,
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
        "Stochastic-depth rate of the last block; drop_path_schedule sets the other blocks'",
        bounds="rate",
        training_only=True,
        counted=False,
    )
    drop_path_schedule: str = option(
        "linear",
        "How the stochastic-depth rate varies over the blocks: 'linear' (rising from 0 at the "
        "first block to drop_path at the last, as timm) or 'uniform' (drop_path at every block, "
        "as DeiT III trains)",
        choices=DROP_PATH_SCHEDULES,
        training_only=True,
        counted=False,
    )
    norm_eps: float = option(1e-6, "The norms' epsilon", bounds="non_negative", counted=False)
    norm_layer: str = option(
        "layer",
        "The norms (the blocks', the final one, norm_pre, fc_norm, the feed-forward's and the "
        "attention pool's): 'layer' (LayerNorm) or 'rms' (RMSNorm: no mean subtracted, no bias; "
        "ViT-22B, timm's norm_layer=RmsNorm)",
        choices=NORM_LAYERS,
        feature="RMSNorm",
    )
    qk_norm: str = option(
        "none",
        "A norm of each head's queries and keys before their product: 'layer' or 'rms' (over the "
        "head's width, eps norm_eps; ViT-22B, timm's qk_norm), which keeps the attention logits "
        "from growing; 'none'",
        choices=QK_NORMS,
        feature="QK-norm",
    )
    layer_scale_init: float = option(
        0.0,
        "LayerScale (CaiT; DeiT III, DINOv2): a learned per-channel scale on each residual branch, "
        "initialised to this value (DeiT III 1e-6, DINOv2 1e-5); 0: none",
        bounds="non_negative",
        feature="LayerScale",
    )
    representation_size: int | None = option(
        None,
        "A pre-logits layer before the head: Linear(width, this) + Tanh, as the original ViT, "
        "torchvision's and big_vision's rep_size (its \"Better plain ViT baselines\" config: "
        "rep_size True, the model's width); None: none",
        bounds="positive",
        key=Key(
            default=0,
            read=lambda size: size or None,
            bounds="non_negative",
            why="the key cannot hold None: 0 is none",
        ),
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
    key_bias: bool = option(
        True,
        "With qkv_bias, a bias for the keys too; False: the queries' and values' only (q_bias, "
        "v_bias: EVA's attention). A key bias adds the same amount to every logit of a query's "
        "row, which the softmax cancels",
        feature=Feature("q and v biases", on=lambda a: a.qkv_bias and not a.key_bias),
    )
    proj_bias: bool = option(
        True,
        "A bias in the attention's output projection and the feed-forward's layers; False: "
        "bias-free (timm's proj_bias=False, ViT-22B)",
    )
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

    @property
    def ffn_hidden(self):
        """The feed-forward's hidden width (of each half of a SwiGLU): ``ffn_hidden_width``."""
        return ffn_hidden_width(self.mlp_dim, self.ffn_width, self.ffn_align)

    def check(self):
        """Raises VitArgsError (naming the argument) unless the model can be built: each field's
        declared values and bounds, then what holds between fields."""
        check_options(self, VitArgsError)
        check_between_fields(self)
        return self


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


def ffn_hidden_width(mlp_dim, ffn_width="mlp_dim", ffn_align=0):
    """The feed-forward's hidden width: ``mlp_dim``, or two thirds of it (``ffn_width``
    "two_thirds"), rounded up to a multiple of ``ffn_align`` (0: as it is)."""
    width = mlp_dim * 2 // 3 if ffn_width == "two_thirds" else mlp_dim
    return width + (-width % ffn_align if ffn_align else 0)


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
