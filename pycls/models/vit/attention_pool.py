"""Multihead attention pooling (MAP), the classifier ``VitArgs.classifier == "map"``: a learned
probe attends over every token of an image, then an MLP adds its residual ("Scaling Vision
Transformers", Zhai et al. 2022; SigLIP). The layout and the names are timm 1.0.31's
``AttentionPoolLatent`` (``timm/layers/attention_pool.py``) as its ``VisionTransformer`` builds it
for ``global_pool='map'``: ``latent``, ``q``, ``kv``, ``proj``, ``norm``, ``mlp``."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from pycls.models.vit.feed_forward import Mlp


class AttentionPool(nn.Module):
    """Tokens (N, L, D) or (L, N, D) -> one feature vector (N, D) per image.

    The probe ``latent`` (1, 1, D) is projected to the queries (``q``), the tokens to keys and
    values (``kv``); the heads' attention is projected back (``proj``), and ``x + mlp(norm(x))``
    is the result. ``norm``: a callable making the model's norm; the MLP is GELU, of hidden
    width ``mlp_dim``.
    """

    def __init__(self, *, width, num_heads, mlp_dim, norm, batch_first=True):
        super().__init__()
        self.num_heads, self.batch_first = num_heads, batch_first
        self.latent = nn.Parameter(torch.zeros(1, 1, width))
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(width, width)
        self.norm = norm(width)
        self.mlp = Mlp(width=width, mlp_dim=mlp_dim)

    @torch.no_grad()
    def reset_latent(self) -> None:
        """The probe as timm draws it: truncated normal of std width ** -0.5 (at two std)."""
        std = self.latent.shape[-1] ** -0.5
        nn.init.trunc_normal_(self.latent, std=std, a=-2 * std, b=2 * std)

    def _query(self) -> torch.Tensor:
        """The probe's queries, (heads, head_dim)."""
        width = self.latent.shape[-1]
        return self.q(self.latent).reshape(self.num_heads, width // self.num_heads)

    def _finish(self, pooled: torch.Tensor) -> torch.Tensor:
        """The heads' attention (N, D) -> the pooled features (N, D)."""
        x = self.proj(pooled)
        return x + self.mlp(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_first:
            x = x.transpose(0, 1)
        n, length, width = x.shape
        heads = self.num_heads
        # the probe's query per image, as timm computes it (the FLOPs are counted per image);
        # repeated, not an expanded view: torch's module tracker (FlopCounterMode) cannot hook
        # a view of a parameter made under no_grad
        q = self.q(self.latent.repeat(n, 1, 1)).reshape(n, 1, heads, -1).transpose(1, 2)
        k, v = self.kv(x).reshape(n, length, 2, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.attend(q.to(k.dtype), k, v)  # (N, heads, 1, head_dim)
        return self._finish(out.reshape(n, width))

    def attend(self, q, k, v):
        """The probe's attention over the tokens. Under tensor parallelism q, k and v are
        replicated DTensors, attended on each process's whole copy (``pycls.models.vit.tensor_plan``
        gives the module its own: DTensor has no rule for SDPA's backward on the CPU)."""
        return F.scaled_dot_product_attention(q, k, v)

    def pool_segments(self, tokens: torch.Tensor, image: torch.Tensor, num_images: int):
        """The pooled features (N, D) of the images of a token batch: ``tokens`` (P, D) every
        position that belongs to an image, ``image`` (P,) which. Each image's probe attends
        over its own positions only, the softmax taken per image (in float32)."""
        heads, width = self.num_heads, tokens.shape[-1]
        k, v = self.kv(tokens).reshape(-1, 2, heads, width // heads).unbind(1)
        exact = torch.promote_types(k.dtype, torch.float32)  # float32 at least, as SDPA's
        scores = (k.to(exact) * self._query().to(exact)).sum(-1) / math.sqrt(width // heads)
        per_image = image[:, None].expand(-1, heads)
        top = scores.new_full((num_images, heads), -math.inf)
        top = top.scatter_reduce(0, per_image, scores, "amax")
        weights = (scores - top[image]).exp()
        total = weights.new_zeros(num_images, heads).index_add(0, image, weights)
        summed = weights.new_zeros(num_images, heads, v.shape[-1])
        summed = summed.index_add(0, image, weights[..., None] * v.to(exact))
        out = (summed / total[..., None]).reshape(num_images, width)
        return self._finish(out.to(tokens.dtype))
