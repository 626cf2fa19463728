"""Building blocks of the Vision Transformer.

Every module here takes explicit arguments and never reads a global config, so two models built
with different settings can live in the same process.

Token tensors come in one of two layouts, chosen once per model: batch first, (N, L, D), or batch
second, (L, N, D). Modules that care about the layout take a ``batch_first`` flag, in the spirit
of ``nn.MultiheadAttention``.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pycls.models.vit.args import ATTENTION_BACKENDS, DROP_PATH_MODES
from pycls.models.vit.position import grid_side
from pycls.models.vit.token_masks import attend, skip_residual


class DropPath(nn.Module):
    """Stochastic depth: zeroes the residual branch of whole samples while training.

    ``batch_dim`` says which dimension indexes samples (0 for batch-first tokens, 1 for
    batch-second tokens), so that a dropped sample loses its branch for every token at once.
    Survivors are scaled by 1 / (1 - p) so the expected output is unchanged.

    The rate ``p`` may be set at any time (``module.p = 0.2``). ``forward`` reads only a bool
    (whether the rate is nonzero) and ``keep_prob``, a 0-dim float32 buffer holding 1 - p: never
    a Python float, which torch.compile specialises on torch 2.10 with inductor (one graph per
    rate: a ViT's rates rise block by block, so ViT-B compiled 12 graphs where two serve, one for
    the first block's rate 0 and one for all the others). The buffer
    is non-persistent (checkpoints are as before) and stays float32 whatever the model is cast
    to: ``_apply`` (``.to()``, ``.half()``, ``to_empty()``) rebuilds it from ``p``, and AMP O2
    leaves it as it is (``keeps_float32``: 1 - p rounded to bfloat16 would change what a
    drop-path rate means; ``pycls.models.groups.keeps_float32``).
    """

    keeps_float32 = True

    def __init__(self, p: float = 0.0, *, batch_dim: int = 0):
        super().__init__()
        self.batch_dim = batch_dim
        self.register_buffer("keep_prob", torch.ones((), dtype=torch.float32), persistent=False)
        self.p = p

    @property
    def p(self) -> float:
        return self._p

    @p.setter
    def p(self, p: float) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop-path rate must be in [0, 1), got {p}")
        self._p = float(p)
        self.active = self._p > 0.0
        with torch.no_grad():
            self.keep_prob.fill_(1.0 - self._p)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        device = self.keep_prob.device
        self.keep_prob = torch.full((), 1.0 - self._p, dtype=torch.float32, device=device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.active:
            return x
        mask_shape = [1] * x.ndim
        mask_shape[self.batch_dim] = x.shape[self.batch_dim]
        # A comparison with the rate as a tensor, not bernoulli_(keep), which needs a Python
        # float: every block, whatever its rate, runs the same compiled graph. Drawn in float32
        # whatever x is, so that a sample survives with probability 1 - p, not 1 - p rounded.
        keep = self.keep_prob
        mask = x.new_empty(mask_shape, dtype=torch.float32).uniform_() < keep
        return x * (mask / keep).to(x.dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}, batch_dim={self.batch_dim}"


def place_rates(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Puts the drop-path rates of ``model`` on ``device``; returns the model. For a model built
    on the meta device and filled with ``load_state_dict(assign=True)``: the rates live in
    non-persistent buffers, which no state dict holds, so assignment leaves them on the meta
    device (each DropPath rebuilds its buffer from its ``p``)."""
    for module in model.modules():
        if isinstance(module, DropPath):
            module.to_empty(device=device)
    return model


def _split_heads(qkv: torch.Tensor, num_heads: int, batch_first: bool) -> torch.Tensor:
    """(N, L, 3D) or (L, N, 3D) -> (3, N, H, L, hd), the layout SDPA wants."""
    a, b, three_d = qkv.shape
    qkv = qkv.reshape(a, b, 3, num_heads, three_d // (3 * num_heads))
    # Dims are (a, b, 3, H, hd); move the batch dim (a or b) right after the q/k/v dim.
    return qkv.permute(2, 0, 3, 1, 4) if batch_first else qkv.permute(2, 1, 3, 0, 4)


def _merge_heads(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """(N, H, L, hd) -> (N, L, D) or (L, N, D)."""
    n, h, length, hd = x.shape
    x = x.transpose(1, 2) if batch_first else x.permute(2, 0, 1, 3)
    return x.reshape(*x.shape[:2], h * hd)


# The kernels of scaled_dot_product_attention a model may pin its attention to: "default" lets
# torch pick for each call (what it does without being asked); the others run that kernel only,
# and torch raises "No available kernel" where it cannot (flash and cudnn need CUDA and half
# inputs, efficient needs CUDA; math runs anywhere)
SDPA_BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
assert tuple(SDPA_BACKENDS) == ATTENTION_BACKENDS, "VitArgs.attention_backend's choices"


class Attention(nn.Module):
    """Multi-head self-attention on the fused ``scaled_dot_product_attention`` kernel.

    One ``qkv`` projection (q, k, v stacked in that order along the output features, the same
    packing as ``nn.MultiheadAttention.in_proj_weight``; without bias if not ``qkv_bias``) and
    one output projection ``proj``. ``backend`` (a key of ``SDPA_BACKENDS``) pins the kernel of
    the unmasked attention (``torch.nn.attention.sdpa_kernel``, which torch.compile traces); a
    mask's attention (``token_masks.attend``) is left to torch.
    """

    def __init__(
        self,
        *,
        width: int,
        num_heads: int,
        attn_dropout: float = 0.0,
        dropout: float = 0.0,
        qkv_bias: bool = True,
        batch_first: bool = True,
        backend: str = "default",
    ):
        super().__init__()
        if backend not in SDPA_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of: "
                             + ", ".join(repr(b) for b in SDPA_BACKENDS))  # fmt: skip
        self.num_heads = num_heads
        self.attn_dropout = attn_dropout
        self.batch_first = batch_first
        self.backend = backend
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        self.proj = nn.Linear(width, width)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """``attn_mask``: None (every token sees every token), a boolean tensor broadcasting to
        (N, heads, L, L) (True: may attend) or a FlexAttention BlockMask (``token_masks``)."""
        q, k, v = _split_heads(self.qkv(x), self.num_heads, self.batch_first).unbind(0)
        dropout_p = self.attn_dropout if self.training else 0.0
        if attn_mask is None:
            with self._kernel():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:
            out = attend(q, k, v, attn_mask, dropout_p)
        return self.proj_drop(self.proj(_merge_heads(out, self.batch_first)))

    def _kernel(self):
        kernel = SDPA_BACKENDS[self.backend]
        return contextlib.nullcontext() if kernel is None else sdpa_kernel([kernel])


class Mlp(nn.Module):
    """The standard transformer feed-forward network: Linear, GELU, Dropout, Linear, Dropout."""

    def __init__(self, *, width: int, mlp_dim: int, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(width, mlp_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(mlp_dim, width)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class LocalFeedForward(nn.Module):
    """Feed-forward network with a 3x3 depthwise convolution over the patch grid (LocalViT).

    Linear -> Hardswish -> depthwise 3x3 Conv2d -> Hardswish -> Linear -> Dropout, as used in
    "Training a ViT from scratch in less than 24 hours with 1 GPU". The convolution mixes each
    hidden channel with its spatial neighbours, giving the locality bias that helps ViTs trained
    on little data. The grid side is inferred from the token count, so the module follows the
    model through ``set_image_size`` without being told. The first ``num_prefix_tokens`` tokens
    (the class token) have no grid position: they bypass the convolution (an identity step) but
    go through every pointwise layer.
    """

    def __init__(
        self,
        *,
        width: int,
        mlp_dim: int,
        num_prefix_tokens: int = 0,
        dropout: float = 0.0,
        batch_first: bool = True,
    ):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.batch_first = batch_first
        self.fc1 = nn.Linear(width, mlp_dim)
        self.act1 = nn.Hardswish()
        self.dwconv = nn.Conv2d(mlp_dim, mlp_dim, kernel_size=3, padding=1, groups=mlp_dim)
        self.act2 = nn.Hardswish()
        self.fc2 = nn.Linear(mlp_dim, width)
        self.drop = nn.Dropout(dropout)

    def _conv_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Depthwise conv over patch tokens given as (N, Lp, C) or (Lp, N, C)."""
        length = x.shape[1] if self.batch_first else x.shape[0]
        side = grid_side(length)
        grid = x.permute(0, 2, 1) if self.batch_first else x.permute(1, 2, 0)  # (N, C, Lp)
        grid = self.dwconv(grid.reshape(*grid.shape[:2], side, side)).flatten(2)
        return grid.transpose(1, 2) if self.batch_first else grid.permute(2, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.fc1(x))
        seq_dim = 1 if self.batch_first else 0
        prefix, patches = x.split(
            [self.num_prefix_tokens, x.shape[seq_dim] - self.num_prefix_tokens], dim=seq_dim
        )
        x = torch.cat([prefix, self._conv_patches(patches)], dim=seq_dim)
        return self.drop(self.fc2(self.act2(x)))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block; takes and returns the token tensor only.

    x = x + drop_path(attn(ln_1(x))); x = x + drop_path(ffn(ln_2(x))).
    Keeping the signature tensor-in, tensor-out lets pipeline stages and FSDP wrap blocks
    one by one and lets activation checkpointing call them directly. The one optional extra,
    ``attn_mask``, is for sequences with padding or several images (``token_masks``).

    ``drop_path_mode``: "multiply" (every sample's branch is computed, the dropped ones
    multiplied by zero) or "skip" (the branch runs on the kept samples only, added back with
    the 1 / keep-fraction scale: ``token_masks.skip_residual``). ``attention_backend``: the
    attention's SDPA kernel (``SDPA_BACKENDS``).
    """

    def __init__(
        self,
        *,
        width: int,
        num_heads: int,
        mlp_dim: int,
        ffn: str = "mlp",
        num_prefix_tokens: int = 1,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        qkv_bias: bool = True,
        batch_first: bool = True,
        drop_path_mode: str = "multiply",
        attention_backend: str = "default",
    ):
        super().__init__()
        if drop_path_mode not in DROP_PATH_MODES:
            raise ValueError(f"unknown drop_path_mode {drop_path_mode!r}; expected one of: "
                             + ", ".join(repr(m) for m in DROP_PATH_MODES))  # fmt: skip
        self.num_prefix_tokens = num_prefix_tokens
        self.drop_path_mode = drop_path_mode
        self.ln_1 = nn.LayerNorm(width, eps=norm_eps)
        self.attn = Attention(
            width=width,
            num_heads=num_heads,
            attn_dropout=attn_dropout,
            dropout=dropout,
            qkv_bias=qkv_bias,
            batch_first=batch_first,
            backend=attention_backend,
        )
        self.ln_2 = nn.LayerNorm(width, eps=norm_eps)
        if ffn == "mlp":
            self.ffn = Mlp(width=width, mlp_dim=mlp_dim, dropout=dropout)
        elif ffn == "local":
            self.ffn = LocalFeedForward(
                width=width,
                mlp_dim=mlp_dim,
                num_prefix_tokens=num_prefix_tokens,
                dropout=dropout,
                batch_first=batch_first,
            )
        else:
            raise ValueError(f"unknown ffn {ffn!r}; expected one of: 'mlp', 'local'")
        self.drop_path = DropPath(drop_path, batch_dim=0 if batch_first else 1)

    def forward(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        # The mode and the bool first: the rate as a Python float is read in skip mode only,
        # whose kept count is a constant of the graph anyway
        if self.drop_path_mode == "skip" and self.training and self.drop_path.active:
            p, dim = self.drop_path.p, self.drop_path.batch_dim
            x = skip_residual(x, self._attention_branch, p, batch_dim=dim, attn_mask=attn_mask)
            return skip_residual(x, self._ffn_branch, p, batch_dim=dim)
        x = x + self.drop_path(self.attn(self.ln_1(x), attn_mask))
        return x + self.drop_path(self.ffn(self.ln_2(x)))

    def _attention_branch(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        return self.attn(self.ln_1(x), attn_mask)

    def _ffn_branch(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        return self.ffn(self.ln_2(x))


def _to_tokens(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """Feature map (N, D, h, w) -> tokens (N, h*w, D) or (h*w, N, D), row-major over the grid.

    Contiguous in the token layout: as a view of the feature map the features would have stride
    h*w, and elementwise ops keep an input's strides, so the whole residual stream would inherit
    them and every LayerNorm and Linear of every block would copy its input first.
    """
    x = x.flatten(2)
    return (x.transpose(1, 2) if batch_first else x.permute(2, 0, 1)).contiguous()


class PatchifyStem(nn.Module):
    """The original ViT stem: one conv with kernel = stride = patch size (bias optional)."""

    def __init__(
        self,
        *,
        in_channels: int,
        width: int,
        patch_size: int,
        batch_first: bool = True,
        bias: bool = True,
    ):
        super().__init__()
        self.batch_first = batch_first
        self.proj = nn.Conv2d(
            in_channels, width, kernel_size=patch_size, stride=patch_size, bias=bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _to_tokens(self.proj(x), self.batch_first)


class ConvBnReLU(nn.Module):
    """Conv (no bias: BatchNorm has its own shift) + BatchNorm + ReLU, 'same'-style padding."""

    def __init__(self, *, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size=kernel_size,
            stride=stride,
            padding=(kernel_size - 1) // 2,
            bias=False,
        )
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class ConvStem(nn.Module):
    """Stack of strided convs then a 1x1 conv to ``width``.

    From "Early convolutions help transformers see better" (Xiao et al., 2021): replacing the
    patchify conv with a few 3x3 convs makes ViT training far less sensitive to the optimizer.
    With odd kernels and padding (k - 1) // 2 each conv maps a side H to ceil(H / stride), so
    when the strides multiply to the patch size the grid matches the patchify stem's.
    """

    def __init__(
        self,
        *,
        in_channels: int,
        width: int,
        channels: tuple[int, ...],
        kernels: tuple[int, ...],
        strides: tuple[int, ...],
        batch_first: bool = True,
    ):
        super().__init__()
        self.batch_first = batch_first
        layers = []
        for out_channels, kernel, stride in zip(channels, kernels, strides):
            layers.append(
                ConvBnReLU(
                    in_channels=in_channels,
                    out_channels=out_channels,
                    kernel_size=kernel,
                    stride=stride,
                )
            )
            in_channels = out_channels
        self.body = nn.Sequential(*layers)
        self.proj = nn.Conv2d(in_channels, width, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _to_tokens(self.proj(self.body(x)), self.batch_first)
