"""Re-export shim: the ViT's token masks (patch dropout, drop-path skip, token batches) now live in
``pycls.models.vit.token_masks``, the ViT's one home. This module re-exports their names so that
``pycls.models.token_masks`` keeps working."""

from pycls.models.vit.args import DROP_PATH_MODES, PACKED_ATTENTIONS
from pycls.models.vit.token_masks import (
    TokenBatch,
    add_kept_residual,
    attend,
    computed_tokens,
    drop_patches,
    embed_token_batch,
    forward_token_batch,
    has_flex_attention,
    kept_patches,
    pool_token_batch,
    position_table,
    sequence_mask,
    skip_residual,
)

__all__ = [
    "DROP_PATH_MODES",
    "PACKED_ATTENTIONS",
    "TokenBatch",
    "add_kept_residual",
    "attend",
    "computed_tokens",
    "drop_patches",
    "embed_token_batch",
    "forward_token_batch",
    "has_flex_attention",
    "kept_patches",
    "pool_token_batch",
    "position_table",
    "sequence_mask",
    "skip_residual",
]
