"""What each dimension of a device mesh costs in communication: bytes a process sends per optimizer
step over ``tp``, ``dp`` and ``pp``, computed from the ViT's shape, the batch and the AMP level
(``step_traffic``), and logged when TRAIN.PARALLEL tensor starts.

Collectives are counted as ring algorithms move data: an all-gather or a reduce-scatter of S
bytes over n processes sends S (n - 1) / n from each process, an all-reduce twice that, a
broadcast S from its source.

- tp (per micro-batch): around each block's attention and feed-forward, an all-gather of the
  sequence shards before and a reduce-scatter of the row-parallel output after, in the forward,
  and the same two transposed in the backward: 8 collectives of the block's activation
  (images x tokens x width), 4 more for a recomputed block; one more gather each for the embedding
  and the final norm, the images' gather, the sequence-parallel norms' gradient all-reduce, and
  once per step the replicated parameters' gradient broadcast;
- dp (FSDP2): per micro-batch an all-gather of this process's part of the weights in the forward
  and, when they are freed after it, again in the backward; per step a reduce-scatter of the
  gradients. With pipeline stages the replicas all-reduce their stage's gradients instead;
- pp: per micro-batch each stage boundary sends the activation forward and its gradient back.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficShape:
    """The numbers the estimate needs (all per process, except the model's dimensions).

    ``split_params`` / ``whole_params``: parameters this process holds of the tensor-parallel
    layers (its share) and of the replicated ones (all of them), over all its stages;
    ``norm_params``: of the sequence-parallel norms (among the replicated ones).
    """

    depth: int
    width: int
    tokens: int
    pixels: int  # per image, times channels
    images: int  # per micro-batch of a tensor-parallel group (its gathered batch)
    accum_steps: int
    split_params: int
    whole_params: int
    norm_params: int
    act_bytes: int
    param_bytes: int
    reduce_bytes: int
    reshard_after_forward: bool = True
    recomputed_blocks: int = 0


def _ring(size, n):
    return size * (n - 1) / n if n > 1 else 0.0


def step_traffic(s, dp, tp, pp=1):
    """Bytes one process sends per optimizer step over each mesh dimension, {"tp", "dp", "pp"}."""
    act = s.images * s.tokens * s.width * s.act_bytes  # one block activation, whole sequence
    depth = s.depth // pp  # the blocks of one stage
    recomputed = min(s.recomputed_blocks, s.depth) // pp
    per_micro = (8 * depth + 4 * recomputed + 2) * _ring(act, tp)
    per_micro += _ring(s.images * s.pixels * 4, tp)  # the group's images, fp32
    per_micro += 2 * _ring(s.norm_params * 4, tp)
    tp_bytes = s.accum_steps * per_micro + (s.whole_params * 4 if tp > 1 else 0)
    local = s.split_params + s.whole_params
    if pp > 1:
        dp_bytes = 2 * _ring(local * s.reduce_bytes, dp)
        # forward activation and backward gradient of the whole batch, as sequence shards
        pp_bytes = s.accum_steps * 2 * act / tp
    else:
        gathers = 2 if s.reshard_after_forward else 1
        dp_bytes = s.accum_steps * gathers * _ring(local * s.param_bytes, dp)
        dp_bytes += _ring(local * s.reduce_bytes, dp)
        pp_bytes = 0.0
    return {"tp": tp_bytes, "dp": dp_bytes, "pp": pp_bytes}


def describe(traffic):
    """One line: MB per step of each dimension."""
    parts = [f"{dim} {traffic[dim] / 1e6:.1f} MB" for dim in ("tp", "dp", "pp")]
    return "communication per optimizer step and process: " + ", ".join(parts)
