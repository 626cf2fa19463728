"""The Vision Transformer's blocks: the sequential pre-norm block (``EncoderBlock``), the parallel
block (``ParallelBlock``), and stochastic depth (``DropPath``). Their parts live beside them, one
concern a module, and their names are importable from here too: the attention
(``attention``), the feed-forward networks (``feed_forward``), the norms and LayerScale
(``norms``), the rotation of queries and keys (``rotary``) and the stems (``stems``).

Every module here takes explicit arguments and never reads a global config, so two models built
with different settings can live in the same process.

Token tensors come in one of two layouts, chosen once per model: batch first, (N, L, D), or batch
second, (L, N, D). Modules that care about the layout take a ``batch_first`` flag, in the spirit
of ``nn.MultiheadAttention``.
"""

import torch
from torch import nn

from pycls.models.vit.args import DROP_PATH_MODES
from pycls.models.vit.attention import (
    SDPA_BACKENDS,
    Attention,
    HeadOptions,
    merge_heads,
    to_heads,
)
from pycls.models.vit.feed_forward import LocalFeedForward, Mlp, make_ffn
from pycls.models.vit.norms import layer_scale, make_norm
from pycls.models.vit.stems import ConvBnReLU, ConvStem, PatchifyStem
from pycls.models.vit.token_masks import skip_residual

__all__ = [
    "SDPA_BACKENDS",
    "Attention",
    "ConvBnReLU",
    "ConvStem",
    "DropPath",
    "EncoderBlock",
    "LocalFeedForward",
    "Mlp",
    "ParallelBlock",
    "PatchifyStem",
    "place_rates",
]


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


def _check_mode(mode):
    if mode not in DROP_PATH_MODES:
        raise ValueError(f"unknown drop_path_mode {mode!r}; expected one of: "
                         + ", ".join(repr(m) for m in DROP_PATH_MODES))  # fmt: skip
    return mode


class EncoderBlock(nn.Module):
    """Pre-norm transformer block; takes and returns the token tensor only.

    x = x + drop_path(ls_1(attn(ln_1(x)))); x = x + drop_path(ls_2(ffn(ln_2(x)))), the LayerScales
    ``ls_1``, ``ls_2`` identities unless ``layer_scale_init``. Keeping the signature tensor-in,
    tensor-out lets pipeline stages and FSDP wrap blocks one by one and lets activation
    checkpointing call them directly. The optional extras: ``attn_mask``, for sequences with
    padding or several images (``token_masks``), and ``positions``, the tokens' coordinates for
    a rotary attention (``rotary``).

    ``drop_path_mode``: "multiply" (every sample's branch is computed, the dropped ones
    multiplied by zero) or "skip" (the branch runs on the kept samples only, added back with
    the 1 / keep-fraction scale: ``token_masks.skip_residual``). ``attention_backend``: the
    attention's SDPA kernel (``SDPA_BACKENDS``). The other options are ``VitArgs``'s of the same
    names (``mlp_dim``: the feed-forward's hidden width, ``VitArgs.ffn_hidden``).
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
        norm_layer: str = "layer",
        key_bias: bool = True,
        proj_bias: bool = True,
        qk_norm: str = "none",
        layer_scale_init: float = 0.0,
        ffn_norm: bool = False,
        rope: str = "none",
        rope_temperature: float = 10000.0,
        rope_layout: str = "interleaved",
    ):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.drop_path_mode = _check_mode(drop_path_mode)
        self.ln_1 = make_norm(norm_layer, width, norm_eps)
        self.attn = Attention(width=width, num_heads=num_heads, attn_dropout=attn_dropout,
                              dropout=dropout, qkv_bias=qkv_bias, batch_first=batch_first,
                              backend=attention_backend, key_bias=key_bias, proj_bias=proj_bias,
                              qk_norm=qk_norm, norm_eps=norm_eps, rope=rope,
                              rope_temperature=rope_temperature,
                              rope_layout=rope_layout)  # fmt: skip
        self.ls_1 = layer_scale(width, layer_scale_init)
        self.ln_2 = make_norm(norm_layer, width, norm_eps)
        hidden_norm = (lambda w: make_norm(norm_layer, w, norm_eps)) if ffn_norm else None
        self.ffn = make_ffn(ffn, width=width, mlp_dim=mlp_dim, dropout=dropout, bias=proj_bias,
                            norm=hidden_norm, num_prefix_tokens=num_prefix_tokens,
                            batch_first=batch_first)  # fmt: skip
        self.ls_2 = layer_scale(width, layer_scale_init)
        self.drop_path = DropPath(drop_path, batch_dim=0 if batch_first else 1)

    def forward(self, x: torch.Tensor, attn_mask=None, positions=None) -> torch.Tensor:
        # The mode and the bool first: the rate as a Python float is read in skip mode only,
        # whose kept count is a constant of the graph anyway
        if self.drop_path_mode == "skip" and self.training and self.drop_path.active:
            p, dim = self.drop_path.p, self.drop_path.batch_dim
            x = skip_residual(x, self._attention_branch, p, batch_dim=dim, attn_mask=attn_mask,
                              positions=positions)  # fmt: skip
            return skip_residual(x, self._ffn_branch, p, batch_dim=dim)
        x = x + self.drop_path(self._attention_branch(x, attn_mask, positions))
        return x + self.drop_path(self.ls_2(self.ffn(self.ln_2(x))))

    def _attention_branch(self, x: torch.Tensor, attn_mask=None, positions=None):
        # positions only when there are some: the tensor-parallel plan prepares the attention's
        # two inputs (tokens and mask)
        extra = () if positions is None else (positions,)
        return self.ls_1(self.attn(self.ln_1(x), attn_mask, *extra))

    def _ffn_branch(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        return self.ls_2(self.ffn(self.ln_2(x)))


class ParallelBlock(HeadOptions):
    """Parallel pre-norm block ("Scaling Vision Transformers to 22 Billion Parameters", Dehghani
    et al. 2023; PaLM): x = x + drop_path(ls(out_proj([attention(h) | mlp(h)]))), h = in_norm(x).

    One input projection ``in_proj`` gives the MLP's hidden units and the queries, keys and
    values ([mlp_dim | q | k | v] along its outputs, timm's ``ParallelScalingBlock``), one output
    projection ``out_proj`` reads the attention's output and the MLP's activations side by side:
    two matrix products where the sequential block has four. ``in_proj``'s bias (``qkv_bias``)
    covers the MLP's inputs too; without it the MLP has its own, ``mlp_bias``, unless
    ``proj_bias`` is off (as ``out_proj``'s). Dropout acts on the MLP's activations (and
    ``attn_dropout`` on the attention weights). The heads' norms and rotation: ``HeadOptions``.
    """

    def __init__(
        self,
        *,
        width: int,
        num_heads: int,
        mlp_dim: int,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        qkv_bias: bool = True,
        batch_first: bool = True,
        drop_path_mode: str = "multiply",
        attention_backend: str = "default",
        norm_layer: str = "layer",
        proj_bias: bool = True,
        qk_norm: str = "none",
        layer_scale_init: float = 0.0,
        rope: str = "none",
        rope_temperature: float = 10000.0,
        rope_layout: str = "interleaved",
    ):
        super().__init__()
        self.num_heads, self.batch_first = num_heads, batch_first
        self.drop_path_mode = _check_mode(drop_path_mode)
        self.in_split = [mlp_dim, width, width, width]
        self.in_norm = make_norm(norm_layer, width, norm_eps)
        self.in_proj = nn.Linear(width, mlp_dim + 3 * width, bias=qkv_bias)
        own_bias = proj_bias and not qkv_bias
        self.mlp_bias = nn.Parameter(torch.zeros(mlp_dim)) if own_bias else None
        self._init_heads(head_dim=width // num_heads, num_heads=num_heads, qk_norm=qk_norm,
                         norm_eps=norm_eps, rope=rope, rope_temperature=rope_temperature,
                         rope_layout=rope_layout, attn_dropout=attn_dropout,
                         backend=attention_backend)  # fmt: skip
        self.mlp_act = nn.GELU()
        self.mlp_drop = nn.Dropout(dropout)
        self.out_proj = nn.Linear(width + mlp_dim, width, bias=proj_bias)
        self.ls = layer_scale(width, layer_scale_init)
        self.drop_path = DropPath(drop_path, batch_dim=0 if batch_first else 1)

    def forward(self, x: torch.Tensor, attn_mask=None, positions=None) -> torch.Tensor:
        if self.drop_path_mode == "skip" and self.training and self.drop_path.active:
            p, dim = self.drop_path.p, self.drop_path.batch_dim
            return skip_residual(x, self._branch, p, batch_dim=dim, attn_mask=attn_mask,
                                 positions=positions)  # fmt: skip
        return x + self.drop_path(self._branch(x, attn_mask, positions))

    def _branch(self, x: torch.Tensor, attn_mask=None, positions=None) -> torch.Tensor:
        hidden, q, k, v = self.in_proj(self.in_norm(x)).split(self.in_split, dim=-1)
        if self.mlp_bias is not None:
            hidden = hidden + self.hidden_bias()
        q, k, v = (to_heads(t, self.num_heads, self.batch_first) for t in (q, k, v))
        attended = merge_heads(self.attend_heads(q, k, v, attn_mask, positions), self.batch_first)
        hidden = self.mlp_drop(self.mlp_act(hidden))
        return self.ls(self.out_proj(torch.cat([attended, hidden.to(attended.dtype)], dim=-1)))

    def hidden_bias(self) -> torch.Tensor:
        """The MLP's own bias (``mlp_bias``). Under tensor parallelism each process adds its
        hidden channels' part (``pycls.models.vit.tensor_plan`` gives the block its own)."""
        return self.mlp_bias


def drop_path_rate(a, index: int) -> float:
    """The stochastic-depth rate of block ``index`` of the ViT of arguments ``a`` (a ``VitArgs``):
    ``a.drop_path`` at every block (``a.drop_path_schedule`` "uniform"), or rising linearly from 0
    at the first block to it at the last ("linear")."""
    if a.drop_path_schedule == "uniform":
        return a.drop_path
    return a.drop_path * index / max(a.depth - 1, 1)


def build_block(a, index: int, *, num_prefix_tokens: int, batch_first: bool) -> nn.Module:
    """Block ``index`` of the ViT of arguments ``a`` (a ``VitArgs``): sequential or parallel
    (``a.block``), with its drop-path rate (``drop_path_rate``)."""
    common = dict(
        width=a.width,
        num_heads=a.num_heads,
        mlp_dim=a.ffn_hidden,
        dropout=a.dropout,
        attn_dropout=a.attn_dropout,
        drop_path=drop_path_rate(a, index),
        norm_eps=a.norm_eps,
        qkv_bias=a.qkv_bias,
        batch_first=batch_first,
        drop_path_mode=a.drop_path_mode,
        attention_backend=a.attention_backend,
        norm_layer=a.norm_layer,
        proj_bias=a.proj_bias,
        qk_norm=a.qk_norm,
        layer_scale_init=a.layer_scale_init,
        rope=a.rope,
        rope_temperature=a.rope_temperature,
        rope_layout=a.rope_layout,
    )
    if a.block == "parallel":
        return ParallelBlock(**common)
    return EncoderBlock(**common, ffn=a.ffn, num_prefix_tokens=num_prefix_tokens,
                        key_bias=a.key_bias, ffn_norm=a.ffn_norm)  # fmt: skip
