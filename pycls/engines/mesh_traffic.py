"""What each engine sends: bytes a process sends per optimizer step over each dimension of its
device mesh, from the model's parameter shapes, the batch and the AMP level; every engine logs it
at start (``describe``). Plain arithmetic, no torch: the scaling model
(``benchmarks/scaling_model.py``) prices the same bytes on a cluster's links.

The dimensions: ``tp`` (tensor parallelism), ``dp_shard`` (FSDP2's all-gathers and
reduce-scatters, over the processes that share a model's shards), ``dp_replicate`` (the
all-reduce between full or sharded replicas: DDP, HSDP's replicas, the pipeline's) and ``pp``
(between pipeline stages). Collectives are counted as ring algorithms move data: an all-gather
or a reduce-scatter of S bytes over n processes sends S (n - 1) / n from each process, an
all-reduce twice that, a broadcast S from its source. ``tests/engines/test_tensor_parallel.py``
holds these estimates to the bytes the collectives of a step carry (DDP, FSDP2, HSDP, dp x tp).

- DDP: per step, the all-reduce of every gradient (half gradients summed in fp32 by its comm
  hook unless AMP.REDUCE_DTYPE compute) and the broadcast of rank 0's buffers;
- FSDP2 (``fsdp_traffic``): per micro-batch each unit (a block, the root, a batch norm) gathers
  its parameters (cast to the compute dtype first), twice when FSDP.RESHARD_AFTER_FORWARD frees
  them after the forward; per step a reduce-scatter of the gradients and, with replicas (HSDP),
  an all-reduce of each gradient shard across them. FSDP2 cuts every parameter along its first
  dimension into equal parts, padded: a (1, 197, 768) position embedding over 64 processes moves
  64 rows, of which 63 padding (``padded``);
- tp (per micro-batch): around each block's attention and feed-forward (the parallel block's one
  fused sublayer), an all-gather of the sequence shards before and a reduce-scatter of the
  row-parallel output after, in the forward, and the same two transposed in the backward: 8
  collectives of the block's activation (images x tokens x width, the tokens padded to equal
  shards), 4 more for a recomputed block (4 and 2 for the parallel block); a norm of the hidden
  activations all-reduces its statistics, a few float32 values per token; one more gather each
  for the embedding and the final norm, the images' and labels' gather; once per step the
  all-reduce of the partial gradients of the replicated layers that see part of the tokens or
  heads (the sequence-parallel norms and LayerScales, the QK-norms) and the broadcast of this
  process's shard of the replicated parameters' gradients;
- pp: per micro-batch each stage boundary sends the activation forward and its gradient back; the
  replicas of a stage all-reduce its gradients once per step.
"""

from dataclasses import dataclass

DIMS = ("tp", "dp_shard", "dp_replicate", "pp")


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: the ``(rows, rest)`` of each of its parameters (first dimension, and the
    product of the others), of those that get gradients (TRAIN.FREEZE's do not), and the bytes of
    an element as gathered (the compute dtype)."""

    shapes: tuple
    grad_shapes: tuple
    param_bytes: int


@dataclass(frozen=True)
class TrafficShape:
    """The numbers the tensor-parallel estimate needs (all per process, except the model's
    dimensions).

    ``split_params`` / ``whole_params``: parameters this process holds of the tensor-parallel
    layers (its share) and of the replicated ones (all of them), over all its stages;
    ``whole_shard``: its FSDP2 shard of the replicated ones (their gradients are made to agree
    over tp once per step; ``whole_params`` without FSDP2); ``norm_params``: of the replicated
    layers whose gradients are partial sums over tp (the sequence-parallel norms and LayerScales,
    the QK-norms). ``sublayers``: the sublayers of a block whose input is gathered (the
    sequential block's attention and feed-forward, the parallel block's one);
    ``hidden_norm_values``: the float32 values per token a block's hidden norm all-reduces,
    forward and backward (a LayerNorm 4, half of them forward; an RMSNorm 2; none 0).
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
    whole_shard: int = 0
    sublayers: int = 2
    hidden_norm_values: int = 0


def ring(size, n):
    """Bytes one process sends in an all-gather or reduce-scatter of ``size`` bytes over ``n``."""
    return size * (n - 1) / n if n > 1 else 0.0


def padded(shapes, n):
    """Elements of ``shapes`` (``(rows, rest)`` pairs) once FSDP2 pads each first dimension to a
    multiple of ``n`` processes (``torch.chunk``'s equal parts)."""
    return sum(-(-rows // n) * n * rest for rows, rest in shapes)


def empty():
    return dict.fromkeys(DIMS, 0.0)


def ddp_traffic(grad_bytes, buffer_bytes, world):
    """DDP: once per step the gradients' all-reduce (``grad_bytes``, as reduced) and the
    buffers' broadcast (at the first forward after a synchronising backward: accumulation's
    other micro-batches skip it)."""
    out = empty()
    if world > 1:
        out["dp_replicate"] = 2 * ring(grad_bytes, world) + buffer_bytes
    return out


def fsdp_traffic(units, replicate, shard, accum_steps=1, reduce_bytes=4, reshard=True):
    """FSDP2 over ``replicate x shard`` processes (``replicate`` 1: plain FSDP2) of ``units``."""
    gathers = 2 if reshard else 1
    out = empty()
    for unit in units:
        gathered = padded(unit.shapes, shard) * unit.param_bytes
        reduced = padded(unit.grad_shapes, shard) * reduce_bytes
        out["dp_shard"] += accum_steps * gathers * ring(gathered, shard) + ring(reduced, shard)
        out["dp_replicate"] += 2 * ring(reduced / shard, replicate)
    return out


def pipeline_traffic(stage_grad_bytes, replicas, activation_bytes, stages, accum_steps=1):
    """Pipeline stages (TRAIN.PARALLEL pipeline, and tensor with MESH.PP > 1): per micro-batch
    the activation forward and its gradient back at a stage boundary (``activation_bytes``: the
    replica batch's, over its micro-batches), per step the all-reduce of a stage's gradients
    over its replicas."""
    out = empty()
    out["dp_replicate"] = 2 * ring(stage_grad_bytes, replicas)
    if stages > 1:
        out["pp"] = accum_steps * 2 * activation_bytes
    return out


def step_traffic(s, dp, tp, pp=1, units=(), replicate=1):
    """TRAIN.PARALLEL tensor (and pipeline: ``tp`` 1): bytes per optimizer step over each
    dimension. ``units``: FSDP2's over ``dp`` (``replicate`` x the rest), of this process's
    tensor-parallel shapes; with ``pp`` > 1 the replicas all-reduce instead."""
    act = s.images * s.tokens * s.width * s.act_bytes  # one block activation, whole sequence
    # sequence shards of equal length: 17 tokens over 2 processes travel as 2 x 9
    shards = -(-s.tokens // tp) * tp * s.images * s.width * s.act_bytes
    depth = s.depth // pp  # the blocks of one stage
    recomputed = min(s.recomputed_blocks, s.depth) // pp
    per_micro = (4 * s.sublayers * depth + 2 * s.sublayers * recomputed + 2) * ring(shards, tp)
    statistics = s.images * s.tokens * 4  # one float32 value per token, of every token
    norm_values = depth * s.hidden_norm_values + recomputed * s.hidden_norm_values // 2
    per_micro += norm_values * 2 * ring(statistics, tp)  # all-reduces
    per_micro += ring(s.images * (s.pixels * 4 + 8), tp)  # the group's images (fp32), labels
    # once per step: the norms' partial gradients (accumulated), the replicated ones' broadcast
    whole = s.whole_params if pp > 1 else s.whole_shard
    per_step = 2 * ring(s.norm_params * 4, tp) + (whole * 4 if tp > 1 else 0)
    if pp > 1:  # the activations travel as sequence shards
        grads = (s.split_params + s.whole_params) * s.reduce_bytes
        out = pipeline_traffic(grads, dp, act / tp, pp, s.accum_steps)
    else:
        shard = dp // replicate
        out = fsdp_traffic(
            units, replicate, shard, s.accum_steps, s.reduce_bytes, s.reshard_after_forward
        )
    out["tp"] = s.accum_steps * per_micro + per_step
    return out


def describe(traffic):
    """One line: MB per step of each dimension."""
    parts = [f"{dim} {traffic[dim] / 1e6:.1f} MB" for dim in DIMS]
    return "communication per optimizer step and process: " + ", ".join(parts)
