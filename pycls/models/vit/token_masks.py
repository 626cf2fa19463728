"""Fewer tokens through the Vision Transformer: the model-side helpers.

- Patch dropout (``drop_patches``): while training, each image keeps a random subset of its patch
  tokens after the position embedding ("PatchDropout", Liu et al. 2022; FLIP, Li et al. 2023);
  the class and register tokens always stay. Evaluation sees every token.
- Token batches (``TokenBatch``, ``forward_token_batch``): images of different patch grids in one
  batch, as sequences padded to a common length or packed several to a sequence (NaViT, Dehghani
  et al. 2023), with attention kept inside each image (an SDPA boolean mask, or a FlexAttention
  block mask) and pooling per image. The loader builds the index tensors
  (``pycls.datasets.loading.token_batches``); here they are applied.
- Compute-skipping stochastic depth (``skip_residual``): a block's branch runs only on the
  samples it keeps, as DINOv2's ``drop_add_residual_stochastic_depth``.
- Counting (``computed_tokens``): the sequence positions the blocks compute for an input, padding
  included, read from host-side numbers only (no device sync).

Nothing here reads a config; the model (``pycls.models.vit``) calls these with its own arguments.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # a torch without FlexAttention: packed sequences use SDPA boolean masks
    BlockMask = create_block_mask = flex_attention = None


def has_flex_attention() -> bool:
    """Whether this torch has FlexAttention (torch.nn.attention.flex_attention)."""
    return flex_attention is not None


# ------------------------------------------------------------------------------------------------ #
# Attention with a mask
# ------------------------------------------------------------------------------------------------ #


def attend(q, k, v, attn_mask, dropout_p=0.0):
    """Attention of (N, H, L, hd) queries, keys and values under ``attn_mask``: a boolean tensor
    (True: may attend; SDPA) or a FlexAttention BlockMask."""
    if isinstance(attn_mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    if dropout_p > 0:
        raise ValueError("FlexAttention has no attention dropout; use packed attention 'sdpa'")
    return flex_attention(q, k, v, block_mask=attn_mask)


# ------------------------------------------------------------------------------------------------ #
# Patch dropout
# ------------------------------------------------------------------------------------------------ #


def kept_patches(num_patches: int, rate: float) -> int:
    """Patch tokens an image keeps under patch dropout at ``rate`` (at least one), as timm's
    PatchDropout counts them."""
    return max(1, int(num_patches * (1.0 - rate)))


def drop_patches(
    x: torch.Tensor, rate: float, num_prefix: int, batch_first: bool, *, return_index=False
):
    """Tokens (N, L, D) or (L, N, D) -> the same with each image's patch tokens cut to a random
    ``kept_patches`` of them (a fresh subset per image); the first ``num_prefix`` tokens (class
    token, registers) are kept. Order among the kept tokens carries no meaning: the position
    embedding was added before, and a rotary attention's positions are gathered alike. With
    ``return_index``: also where each kept token was, (N, kept tokens) indices of the sequence
    (the prefix's first)."""
    if not batch_first:
        x = x.transpose(0, 1)
    n, length, width = x.shape
    patches = length - num_prefix
    keep = kept_patches(patches, rate)
    order = torch.rand(n, patches, device=x.device).argsort(dim=1)[:, :keep] + num_prefix
    kept = x.gather(1, order.unsqueeze(-1).expand(-1, -1, width))
    x = torch.cat([x[:, :num_prefix], kept], dim=1) if num_prefix else kept
    x = x if batch_first else x.transpose(0, 1).contiguous()
    if not return_index:
        return x
    prefix = torch.arange(num_prefix, device=order.device).expand(n, -1)
    return x, torch.cat([prefix, order], dim=1)


# ------------------------------------------------------------------------------------------------ #
# Compute-skipping stochastic depth
# ------------------------------------------------------------------------------------------------ #


def skip_residual(x, branch, p, *, batch_dim=0, attn_mask=None, positions=None):
    """``x + drop_path(branch(x))`` computing the branch only for the samples kept: a random
    ``max(1, floor(n (1 - p)))`` of the n samples, their branch scaled by n / kept (so that the
    expectation over the draw is ``x + branch(x)``, as with the multiply-by-zero drop path).
    ``branch(x_kept, attn_mask_kept[, positions_kept])``; a per-sequence ``attn_mask`` and
    per-sequence ``positions`` (a rotary attention's, (N, L, 2)) are cut to the kept rows."""
    n = x.shape[batch_dim]
    keep = max(1, int(n * (1.0 - p)))
    kept = torch.randperm(n, device=x.device)[:keep]
    return add_kept_residual(x, branch, kept, n / keep, batch_dim=batch_dim, attn_mask=attn_mask,
                             positions=positions)  # fmt: skip


def add_kept_residual(x, branch, kept, scale, *, batch_dim=0, attn_mask=None, positions=None):
    """``x`` plus ``scale`` times the branch of the samples ``kept`` (an index tensor), added
    into their rows (index_add): what ``x + branch(x) * m`` computes for the mask m that is
    ``scale`` on the kept samples and 0 elsewhere, without computing the others' branch."""
    sub = x.index_select(batch_dim, kept)
    if isinstance(attn_mask, torch.Tensor):
        if attn_mask.shape[0] > 1:
            attn_mask = attn_mask.index_select(0, kept)
    elif attn_mask is not None:
        raise ValueError(
            "drop_path_mode 'skip' cannot cut a FlexAttention BlockMask to the kept "
            "sequences; use packed attention 'sdpa'"
        )
    if positions is None:
        out = branch(sub, attn_mask)
    else:  # one sequence of positions for the batch (L, 2), or one per sequence (N, L, 2)
        out = branch(sub, attn_mask, positions.index_select(0, kept) if positions.ndim == 3
                     else positions)  # fmt: skip
    return x.index_add(batch_dim, kept, out.to(x.dtype), alpha=scale)


# ------------------------------------------------------------------------------------------------ #
# Token batches: images of several grids, padded or packed into sequences
# ------------------------------------------------------------------------------------------------ #


class TokenBatch(NamedTuple):
    """A batch of N images of different patch grids as S sequences of L positions.

    Tensors (the loader builds them: ``pycls.datasets.loading.token_batches.collate_token_batch``):

    - ``canvas`` (N, C, H, W): each image in the top-left corner of a canvas the size of the
      largest (uint8 from the loader, float once normalised on the device);
    - ``token_index`` (S, L): each position's row in the source table [prefix tokens (class
      token, registers) | the canvas's patch tokens, image-major, row-major];
    - ``pos_index`` (S, L): its row in the position table [the prefix rows | the table of each
      grid of ``pos_grids`` in turn];
    - ``segments`` (S, L): the image each position belongs to, -1 for padding;
    - ``pool_index`` / ``pool_image`` (P,): the flat position (s * L + l) of every patch token and
      its image; ``pool_count`` (N,): patch tokens per image (float);
    - ``first_token`` (N,): the flat position of each image's first token (its class token).

    Host values (never on the device, so reading them waits for nothing): ``image_grids`` the
    (h, w) grid of each image, ``pos_grids`` the distinct grids, ``packed`` whether a sequence
    may hold several images, ``counts`` (image tokens, sequence positions computed).
    """

    canvas: torch.Tensor
    token_index: torch.Tensor
    pos_index: torch.Tensor
    segments: torch.Tensor
    pool_index: torch.Tensor
    pool_image: torch.Tensor
    pool_count: torch.Tensor
    first_token: torch.Tensor
    image_grids: tuple
    pos_grids: tuple
    packed: bool
    counts: tuple

    @property
    def num_images(self) -> int:
        return self.canvas.shape[0]

    @property
    def padded(self) -> bool:
        """Whether some positions are padding."""
        return self.counts[0] < self.counts[1]

    def to(self, target, non_blocking=False):
        """A dtype casts the canvas only (the indices stay integers); a device moves every
        tensor."""
        if isinstance(target, torch.dtype):
            return self._replace(canvas=self.canvas.to(target))
        moved = {
            name: getattr(self, name).to(target, non_blocking=non_blocking)
            for name in self._fields
            if isinstance(getattr(self, name), torch.Tensor)
        }
        return self._replace(**moved)

    def record_stream(self, stream):
        for value in self:
            if isinstance(value, torch.Tensor):
                value.record_stream(stream)


def sequence_mask(batch: TokenBatch, kind: str = "sdpa"):
    """The attention mask keeping each position inside its own image (padding attends to padding
    only, so no row is empty): None when every sequence is one whole image; else a boolean
    (S, 1, L, L) tensor (``kind`` "sdpa") or a FlexAttention BlockMask ("flex")."""
    if not batch.packed and not batch.padded:
        return None
    segments = batch.segments
    if kind == "flex":
        if not has_flex_attention():
            raise RuntimeError("packed attention 'flex' needs a torch with FlexAttention")
        s, length = segments.shape

        def same_image(b, h, q, kv):
            return segments[b, q] == segments[b, kv]

        return create_block_mask(
            same_image, B=s, H=None, Q_LEN=length, KV_LEN=length, device=segments.device
        )
    return segments[:, None, :, None] == segments[:, None, None, :]


def position_table(model, grids) -> torch.Tensor | None:
    """[the prefix rows of the position embedding | its table for each (h, w) grid in turn],
    each table exactly what the model adds to an image of that grid on its own; None for a model
    without one (``pos_embed`` "none")."""
    if model.pos_embed is None:
        return None
    p, prefix = model.patch_size, model.num_prefix_tokens
    parts = [model.pos_embed[0, :prefix]]
    for h, w in grids:
        parts.append(model._pos_embed_for((h * p, w * p))[0, prefix:])
    return torch.cat(parts)


def rotary_positions(model, batch: TokenBatch) -> torch.Tensor | None:
    """The coordinates of every position of the sequences (S, L, 2) for a rotary attention: the
    prefix tokens' and each image's patches' on its own grid, as the model gives an image of that
    grid on its own (``rotary``); None without RoPE. Padding takes the prefix rows'."""
    if model.args.rope == "none":
        return None
    prefix = model.num_prefix_tokens
    device = batch.pos_index.device
    parts = [model.rope_positions(h, w, device=device)[prefix:] for h, w in batch.pos_grids]
    table = torch.cat([parts[0].new_zeros(prefix, 2), *parts])
    return table[batch.pos_index]


def embed_token_batch(model, batch: TokenBatch) -> torch.Tensor:
    """The embedded sequences (S, L, D), batch first: patch tokens and prefix tokens gathered into
    their positions, each with its own grid's position embedding."""
    tokens = model.patch_embed(batch.canvas)
    if not model.batch_first:
        tokens = tokens.transpose(0, 1)
    prefix = [t[0] for t in (model.class_token, model.register_tokens) if t is not None]
    source = torch.cat([*prefix, tokens.reshape(-1, tokens.shape[-1])])
    pos = position_table(model, batch.pos_grids)
    x = source[batch.token_index]
    x = x if pos is None else x + pos[batch.pos_index]
    return model.to_residual(model.norm_pre(model.pos_drop(x)))


def pool_token_batch(model, x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """Encoded sequences (after the final norm, batch first) -> (N, D) per image: its class token
    (the token classifier), the mean of its patch tokens (pooled) or its attention pool's (map:
    the probe attends over the image's own tokens)."""
    flat = x.reshape(-1, x.shape[-1])
    if model.classifier == "token":
        return flat.index_select(0, batch.first_token)
    if model.classifier == "map":
        # padding pools into one more image, dropped: no host sync to find the images' tokens
        image = batch.segments.reshape(-1)
        image = torch.where(image < 0, batch.num_images, image)
        return model.attn_pool.pool_segments(flat, image, batch.num_images + 1)[:-1]
    sums = flat.new_zeros(batch.num_images, flat.shape[-1])
    sums.index_add_(0, batch.pool_image, flat.index_select(0, batch.pool_index))
    return sums / batch.pool_count.to(sums.dtype)[:, None]


def forward_token_batch(model, batch: TokenBatch, *, pre_logits: bool = False) -> torch.Tensor:
    """A VisionTransformer's logits (N, classes) for a TokenBatch: each image's own, as its own
    unpadded forward pass would give them."""
    if model.args.ffn == "local" or model.args.stem != "patchify":
        # the local feed-forward convolves a whole square grid; the conv stem's batch norm would
        # count the canvas's padding in its statistics
        raise ValueError("token batches need an ffn other than 'local' and stem 'patchify'")
    if model.training and model.patch_drop > 0:
        raise ValueError("patch_drop does not apply to token batches: their loader sets the tokens")
    if getattr(model, "dist_token", None) is not None:
        raise ValueError("token batches carry the class and register tokens, not dist_token")
    x = embed_token_batch(model, batch)
    if not model.batch_first:
        x = x.transpose(0, 1).contiguous()
    positions = rotary_positions(model, batch)
    x = model.run_blocks(x, sequence_mask(batch, model.packed_attention), positions=positions)
    x = model.norm(x)
    if not model.batch_first:
        x = x.transpose(0, 1)
    return model.classify(pool_token_batch(model, x, batch), pre_logits=pre_logits)


# ------------------------------------------------------------------------------------------------ #
# Counting
# ------------------------------------------------------------------------------------------------ #


def computed_tokens(model, images) -> int:
    """Sequence positions the blocks of ``model`` compute for ``images`` (a batch tensor or a
    TokenBatch), padding and prefix tokens included, patch dropout applied while training; 0 for
    a model without tokens (the CNNs). Host numbers only: nothing waits for the device."""
    if isinstance(images, TokenBatch):
        return images.counts[1]
    if not hasattr(model, "num_prefix_tokens") or images.ndim != 4 or images.shape[0] == 0:
        return 0
    h, w = images.shape[-2:]
    patches = (h // model.patch_size) * (w // model.patch_size)
    if model.training and model.patch_drop > 0:
        patches = kept_patches(patches, model.patch_drop)
    return images.shape[0] * (model.num_prefix_tokens + patches)
