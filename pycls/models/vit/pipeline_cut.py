"""The ViT cut into pipeline chunks (TRAIN.PARALLEL pipeline; the engine that runs them:
``pycls.engines.pipeline``).

The ViT is cut into ``pp * v`` chunks, v = PIPELINE.STAGES_PER_RANK. Chunk 0 is the embedding and
the first blocks; the last chunk is the last blocks, the final norm and the head. Chunks are
balanced by block count or by parameters (PIPELINE.BALANCE).

Names. A chunk registers the model's own submodules under their own names (blocks keyed by their
index), so that the union of a rank's chunks has the slice of the whole model's state dict that
this rank owns, with the same keys.
"""

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pycls.models.vit.position import grid_side

BALANCES = ("blocks", "params")


def partition(costs, parts, first_extra=0, last_extra=0):
    """Cuts ``costs`` into ``parts`` contiguous non-empty runs minimising the largest run's total.

    ``first_extra`` / ``last_extra`` are added to the first / last run (the embedding and the
    head). Returns a list of ranges. Ties go to the cut that puts less in the earlier runs (the
    first stage of 1F1B holds the most activations in flight).
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {parts} non-empty stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(i, j, k):  # blocks i..j-1 as run k
        return (
            prefix[j]
            - prefix[i]
            + (first_extra if k == 0 else 0)
            + (last_extra if k == parts - 1 else 0)
        )

    inf = float("inf")
    # best[k][j]: smallest max load of the first j blocks cut into k + 1 runs; cut[k][j]: run start
    best = [[inf] * (n + 1) for _ in range(parts)]
    cut = [[0] * (n + 1) for _ in range(parts)]
    for j in range(1, n + 1):
        best[0][j] = load(0, j, 0)
    for k in range(1, parts):
        for j in range(k + 1, n + 1):
            for i in range(k, j):  # earliest start first: ties keep the earlier runs short
                value = max(best[k - 1][i], load(i, j, k))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [], n
    for k in range(parts - 1, 0, -1):
        bounds.append(cut[k][j])
        j = cut[k][j]
    starts = [0, *reversed(bounds)]
    return [range(s, e) for s, e in zip(starts, [*starts[1:], n])]


def _numel(modules):
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def block_ranges(vit, num_chunks, balance="blocks"):
    """The blocks of each chunk: equal counts ("blocks") or equal parameters ("params")."""
    if balance not in BALANCES:
        raise ValueError(f"PIPELINE.BALANCE: {balance!r} is not one of {list(BALANCES)}")
    if balance == "blocks":
        return partition([1] * len(vit.blocks), num_chunks)
    prefix = (getattr(vit, name) for name in _PREFIX_TENSORS)
    embed = _numel([vit.patch_embed, vit.norm_pre])
    embed += sum(t.numel() for t in prefix if isinstance(t, nn.Parameter))
    head = _numel([vit.norm, vit.attn_pool, vit.fc_norm, vit.pre_logits, vit.head])
    costs = [_numel([b]) for b in vit.blocks]
    return partition(costs, num_chunks, first_extra=embed, last_extra=head)


class ViTChunk(nn.Module):
    """A contiguous piece of a VisionTransformer: [embedding] + some blocks + [norm and head].

    The submodules are the model's own objects under the model's names. ``autocast`` is a
    callable returning the context the forward runs in (the AMP level's autocast).
    """

    def __init__(self, vit, blocks, first, last):
        super().__init__()
        self.first, self.last = first, last
        self.block_ids = list(blocks)
        self.checkpoint_blocks = vit.checkpoint_blocks
        self.autocast = contextlib.nullcontext
        if first:
            self.patch_embed = vit.patch_embed
            self.pos_drop = vit.pos_drop
            self.norm_pre = vit.norm_pre
            for name in _PREFIX_TENSORS:
                _share_tensor(self, vit, name)
            self.keep_prefix_gradients_apart()
        self.blocks = nn.ModuleDict({str(i): vit.blocks[i] for i in self.block_ids})
        if last:
            self.norm = vit.norm
            self.attn_pool = vit.attn_pool
            self.fc_norm = vit.fc_norm
            self.pre_logits = vit.pre_logits
            self.head = vit.head
        # The embedding and head code of the model itself (not a registered submodule); the
        # positions of a rotary attention, which every chunk computes for its blocks
        object.__setattr__(self, "_vit", vit if first or last else None)
        object.__setattr__(self, "_rope_vit", vit)

    def keep_prefix_gradients_apart(self):
        """With one image per micro-batch, autograd gives the class token, register tokens and a
        learned position embedding views of one gradient (the stage's receive buffer) instead of
        sums; accumulating the next micro-batch in place would then corrupt them. A copy keeps
        them apart.

        Not on the meta device: a hook stays with the storage-less tensor it was registered on
        (and blocks new ones) once the pipeline's ``materialise`` swaps the real one in; that
        calls this again."""
        for p in (getattr(self, name) for name in _PREFIX_TENSORS):
            if isinstance(p, nn.Parameter) and not p.is_meta:
                p.register_hook(torch.clone)

    def materialised(self):
        """Called once the chunk's tensors are allocated (``PipelinedModel.materialise``)."""
        if self.first:
            self.keep_prefix_gradients_apart()

    def forward(self, x):
        with self.autocast():
            if self.first:
                x = self._vit.embed(x)
            extra = self._rotary_positions(x)
            recompute = self.training and torch.is_grad_enabled()
            for i, block in zip(self.block_ids, self.blocks.values()):
                if recompute and i < self.checkpoint_blocks:
                    x = checkpoint(block, x, *extra, use_reentrant=False)
                else:
                    x = block(x, *extra)
            if self.last:
                return self._vit.forward_head(x)
        # Activations travel to the next stage, whose receive buffers are dense (batch-second
        # tokens come out of the stem as a transposed view)
        return x.contiguous()

    def _rotary_positions(self, x):
        """A rotary attention's extra inputs (no mask, the tokens' positions), computed in each
        chunk from its token count, the square grid of the images the pipeline runs (its stages
        exchange the tokens alone); () without RoPE."""
        vit = self.rope_model
        if vit is None:
            return ()
        length = x.shape[1 if vit.batch_first else 0]
        side = grid_side(length - vit.num_prefix_tokens)
        return (None, vit.rope_positions(side, side, device=x.device))

    @property
    def rope_model(self):
        """The model whose positions a rotary attention needs, or None."""
        vit = self._rope_vit
        return vit if vit is not None and vit.args.rope != "none" else None


# The tensors of the embedding besides the stem (None where the model has none)
_PREFIX_TENSORS = ("class_token", "register_tokens", "pos_embed")


def _share_tensor(module, vit, name):
    """Registers vit's parameter or buffer ``name`` on ``module`` (the same tensor object)."""
    value = getattr(vit, name)
    if value is None or isinstance(value, nn.Parameter):
        module.register_parameter(name, value)
    else:
        module.register_buffer(name, value)
