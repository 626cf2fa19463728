"""The ViT's multi-head self-attention on the fused ``scaled_dot_product_attention`` kernel, with
its options: the qkv projection's biases (all three, the queries' and values' only, none), a norm
of each head's queries and keys (``qk_norm``), their rotation by the tokens' positions (RoPE:
``pycls.models.vit.rotary``) and a bias-free output projection. The parallel block
(``pycls.models.vit.blocks.ParallelBlock``) shares its heads' part (``attend_heads``).
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from pycls.models.vit.args import ATTENTION_BACKENDS
from pycls.models.vit.norms import make_norm
from pycls.models.vit.rotary import Rotary
from pycls.models.vit.token_masks import attend

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


def split_heads(qkv: torch.Tensor, num_heads: int, batch_first: bool) -> torch.Tensor:
    """(N, L, 3D) or (L, N, 3D) -> (3, N, H, L, hd), the layout SDPA wants."""
    a, b, three_d = qkv.shape
    qkv = qkv.reshape(a, b, 3, num_heads, three_d // (3 * num_heads))
    # Dims are (a, b, 3, H, hd); move the batch dim (a or b) right after the q/k/v dim.
    return qkv.permute(2, 0, 3, 1, 4) if batch_first else qkv.permute(2, 1, 3, 0, 4)


def to_heads(x: torch.Tensor, num_heads: int, batch_first: bool) -> torch.Tensor:
    """(N, L, D) or (L, N, D) -> (N, H, L, hd): one of q, k, v projected on its own."""
    a, b, d = x.shape
    x = x.reshape(a, b, num_heads, d // num_heads)
    return x.permute(0, 2, 1, 3) if batch_first else x.permute(1, 2, 0, 3)


def merge_heads(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """(N, H, L, hd) -> (N, L, D) or (L, N, D)."""
    n, h, length, hd = x.shape
    x = x.transpose(1, 2) if batch_first else x.permute(2, 0, 1, 3)
    return x.reshape(*x.shape[:2], h * hd)


def check_backend(backend: str) -> str:
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of: "
                         + ", ".join(repr(b) for b in SDPA_BACKENDS))  # fmt: skip
    return backend


class HeadOptions(nn.Module):
    """What acts on the heads between the projections and SDPA: ``q_norm`` / ``k_norm`` (over
    the head width; identities without ``qk_norm``), the rotation ``rope`` (or None) and the
    pinned SDPA kernel. A base of the modules that own heads, so that their parameters keep the
    names timm gives them (``attn.q_norm.weight``)."""

    def _init_heads(self, *, head_dim, num_heads, qk_norm, norm_eps, rope, rope_temperature,
                    rope_layout, attn_dropout, backend):  # fmt: skip
        with_norm = qk_norm != "none"
        self.q_norm = make_norm(qk_norm, head_dim, norm_eps) if with_norm else nn.Identity()
        self.k_norm = make_norm(qk_norm, head_dim, norm_eps) if with_norm else nn.Identity()
        self.rope = None
        if rope != "none":
            self.rope = Rotary(rope, head_dim=head_dim, num_heads=num_heads,
                               temperature=rope_temperature, layout=rope_layout)  # fmt: skip
        self.attn_dropout = attn_dropout
        self.backend = check_backend(backend)

    def attend_heads(self, q, k, v, attn_mask=None, positions=None):
        """Attention of (N, H, L, hd) q, k, v after the norms and the rotation; ``attn_mask``:
        None, a boolean tensor (True: may attend) or a FlexAttention BlockMask."""
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            if positions is None:
                raise ValueError("a rotary attention needs the tokens' positions")
            q, k = self.rope(q, k, positions)
        # a norm under autocast, or a float32 rotation, can leave q and k in another dtype
        q, k = q.to(v.dtype), k.to(v.dtype)
        dropout_p = self.attn_dropout if self.training else 0.0
        if attn_mask is not None:
            return attend(q, k, v, attn_mask, dropout_p)
        kernel = SDPA_BACKENDS[self.backend]
        with contextlib.nullcontext() if kernel is None else sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


class Attention(HeadOptions):
    """Multi-head self-attention on the fused ``scaled_dot_product_attention`` kernel.

    One ``qkv`` projection (q, k, v stacked in that order along the output features, the same
    packing as ``nn.MultiheadAttention.in_proj_weight``; its bias: all three with ``qkv_bias``,
    or, with ``key_bias`` False, the queries' and values' only, ``q_bias`` and ``v_bias`` as EVA
    keeps them) and one output projection ``proj`` (without bias if not ``proj_bias``).
    ``backend`` (a key of ``SDPA_BACKENDS``) pins the kernel of the unmasked attention
    (``torch.nn.attention.sdpa_kernel``, which torch.compile traces); a mask's attention
    (``token_masks.attend``) is left to torch. ``qk_norm``, ``rope``: ``HeadOptions``.
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
        key_bias: bool = True,
        proj_bias: bool = True,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
        rope: str = "none",
        rope_temperature: float = 10000.0,
        rope_layout: str = "interleaved",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.batch_first = batch_first
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias and key_bias)
        if qkv_bias and not key_bias:
            self.q_bias = nn.Parameter(torch.zeros(width))
            self.v_bias = nn.Parameter(torch.zeros(width))
        else:
            self.q_bias = self.v_bias = None
        self._init_heads(head_dim=width // num_heads, num_heads=num_heads, qk_norm=qk_norm,
                         norm_eps=norm_eps, rope=rope, rope_temperature=rope_temperature,
                         rope_layout=rope_layout, attn_dropout=attn_dropout,
                         backend=backend)  # fmt: skip
        self.proj = nn.Linear(width, width, bias=proj_bias)
        self.proj_drop = nn.Dropout(dropout)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The queries, keys and values of ``x``, [q | k | v] along the features."""
        qkv = self.qkv(x)  # the module itself: its hooks (and float8's layer) see the product
        if self.q_bias is None:
            return qkv
        return qkv + self.qv_bias().to(qkv.dtype)

    def qv_bias(self) -> torch.Tensor:
        """The bias of the qkv product without a key bias, [q_bias | 0 | v_bias]. Under tensor
        parallelism each process adds its heads' part (``pycls.models.vit.tensor_plan`` gives
        the model its own)."""
        return torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])

    def forward(self, x: torch.Tensor, attn_mask=None, positions=None) -> torch.Tensor:
        """``attn_mask``: None (every token sees every token), a boolean tensor broadcasting to
        (N, heads, L, L) (True: may attend) or a FlexAttention BlockMask (``token_masks``);
        ``positions``: the tokens' coordinates, for the rotation (``rotary``)."""
        q, k, v = split_heads(self.project_qkv(x), self.num_heads, self.batch_first).unbind(0)
        out = self.attend_heads(q, k, v, attn_mask, positions)
        return self.proj_drop(self.proj(merge_heads(out, self.batch_first)))
