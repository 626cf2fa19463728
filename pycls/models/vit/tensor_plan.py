"""Tensor and sequence parallelism for the ViT (Megatron-LM's layout, applied with
torch.distributed.tensor.parallel on the model's own submodules): ``parallelize_vit``.

Over the ``tp`` processes of a mesh dimension, each transformer block is split as follows:

- attention: ``qkv`` column-wise (each process computes the queries, keys and values of its
  ``num_heads / tp`` heads), ``proj`` row-wise (each process multiplies its heads' slice, the sum
  is reduce-scattered over the sequence). What acts on the heads between them runs on each
  process's own: the rotation (RoPE; a mixed RoPE's learned frequencies sharded with their
  heads), the QK-norm (its weights, shared by every head, replicated: each process normalises
  its heads, and the weights' gradient is summed over the group), EVA's q and v biases (sharded
  with the queries' and values' columns);
- feed-forward: ``fc1`` column-wise (a SwiGLU's ``fc1_g`` and ``fc1_x`` alike), ``fc2`` row-wise
  (each process holds ``ffn_hidden / tp`` hidden channels); the local feed-forward's depthwise
  convolution works channel by channel, so each process convolves its own hidden channels; a
  norm of the hidden activations (``ffn_norm``) has its weights sharded with the channels and
  its statistics summed over the group (``ChannelParallelNorm``);
- the parallel block: ``in_proj`` column-wise (its MLP inputs, queries, keys and values of this
  process's channels and heads; the MLP's own bias sharded with them), ``out_proj`` row-wise;
- norms (LayerNorm or RMSNorm), LayerScales, dropouts and the residual stream are
  sequence-parallel: between the attention and the feed-forward each process holds ``1 / tp`` of
  the tokens (a DTensor sharded on the sequence dimension, uneven when the token count is not a
  multiple of tp, as 197 tokens are); a norm's or LayerScale's weights are replicated, their
  gradient summed over the group.

The patch embedding, the class and register tokens, the position embedding and the classifier
(the attention pool of the "map" classifier included) are replicated (cheap next to the blocks):
DTensors replicated over the group, which every process computes on the whole batch; the tokens
are cut into sequence shards before the embedding's dropout and gathered again after the final
norm, and the model returns plain logits. Every parameter is thus a DTensor of the one mesh, as
the optimizers' foreach kernels need. A rotary attention's positions are plain tensors, the same
in every process: the whole sequence's, which each process's heads turn after the gather.

Which parameter is placed how is declared once, by name (``SHARDED``, ``REPLICATED``, and
``REFUSED`` for the parameters of options the engine x feature rule refuses under tensor
parallelism); ``parallelize_vit`` refuses a model with a parameter none of them names, and checks
the placements it made against them. A replicated parameter's gradient is whole in every process:
DTensor sums the partial gradients where each process saw part of the tokens or heads (the
sequence-parallel norms and LayerScales, the QK-norms, the row-wise layers' biases) and gathers
the sequence shards' gradient before the replicated embedding, so the copies are equal by
construction; the engine then broadcasts them from the group's first process
(``replicated_parameter_names``: the ``REPLICATED`` ones), so that kernels which are not bitwise
deterministic cannot drift the copies apart.

Random layers run on each process's own slice with its own generator (never on a DTensor, whose
random operators would need the generator shared): dropout on its own tokens or hidden channels,
attention dropout on its own heads. Stochastic depth drops whole samples, so every process of the
group must drop the same ones: its mask is drawn by the group's first process and broadcast.

A fused projection stacks parts along one dimension (``qkv``: [q | k | v] as nn.MultiheadAttention
does; a packed SwiGLU's ``fc1``: [gate | value]; the parallel block's ``in_proj``: [mlp | q | k |
v] and ``out_proj``'s columns: [attention | mlp]), so a contiguous cut of it would give the first
process all queries (all gates) and the last all values. Its rows (columns) are reordered for the
mesh ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...], where q_r are the queries of process r's heads) before the
weights are distributed (``FusedLayout``); every checkpoint, export and import converts back, so
files always hold the model's own layout.
"""

from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pycls.models.vit.args import check_vit_split
from pycls.models.vit.blocks import DropPath, EncoderBlock, LocalFeedForward, ParallelBlock
from pycls.models.vit.fused_layout import FusedLayout, QKVLayout
from pycls.models.vit.norms import NORMS, LayerScale
from pycls.models.vit.position import resample_pos_embed
from pycls.models.vit.tensor_layers import (
    ChannelParallelDepthwise,
    ChannelParallelNorm,
    GroupDropPath,
    LocalDropout,
    LocalPart,
    LocalQVBias,
    LocalReplicatedAttention,
    LocalReplicatedConv,
    shard_parameters,
)

__all__ = [
    "ChannelParallelDepthwise",
    "FusedLayout",
    "GroupDropPath",
    "LocalDropout",
    "QKVLayout",
    "parallelize_vit",
    "placement_of",
    "replicated_parameter_names",
]

# ------------------------------------------------------------------------------------------------ #
# Every parameter of the ViT, by how the plan places it (patterns of parameter names, "*" spanning
# dots). A new option's parameters are named here: tests/models/test_parallel_plan.py builds the
# ViT with every option, and parallelize_vit refuses a parameter none names
# ------------------------------------------------------------------------------------------------ #

# Cut over the group: each process holds its slice (its heads, its hidden channels)
SHARDED = {
    "blocks.*.attn.qkv.*": "column-wise, its rows in the mesh's order (FusedLayout)",
    "blocks.*.attn.q_bias": "with the queries' columns (EVA's q and v biases)",
    "blocks.*.attn.v_bias": "with the values' columns (EVA's q and v biases)",
    "blocks.*.attn.proj.weight": "row-wise",
    "blocks.*.ffn.fc1.*": "column-wise (a packed SwiGLU's rows in the mesh's order: FusedLayout)",
    "blocks.*.ffn.fc1_g.*": "column-wise (a SwiGLU's gate)",
    "blocks.*.ffn.fc1_x.*": "column-wise (a SwiGLU's value)",
    "blocks.*.ffn.norm.*": "with the hidden channels it normalises (ChannelParallelNorm)",
    "blocks.*.ffn.fc2.weight": "row-wise",
    "blocks.*.ffn.dwconv.*": "channel-wise (the local feed-forward's depthwise convolution)",
    "blocks.*.in_proj.*": "column-wise, its rows in the mesh's order (FusedLayout)",
    "blocks.*.mlp_bias": "with the parallel block's MLP columns",
    "blocks.*.rope.freqs": "with the heads (a mixed RoPE's frequencies, per head)",
    "blocks.*.out_proj.weight": "row-wise, its columns in the mesh's order (FusedLayout)",
}
# Held whole by every process, its gradient whole in each (summed over the group where each
# process saw part of the tokens or heads) and broadcast from the group's first process by the
# engine
REPLICATED = {
    "patch_embed.*": "the stem, on the whole batch",
    "class_token": "the embedding's tokens and table",
    "register_tokens": "the embedding's tokens and table",
    "pos_embed": "the embedding's tokens and table",
    "norm_pre.*": "sequence-parallel: each process normalises its tokens",
    "blocks.*.ln_1.*": "sequence-parallel",
    "blocks.*.ln_2.*": "sequence-parallel",
    "blocks.*.in_norm.*": "sequence-parallel",
    "blocks.*.ls_1.*": "sequence-parallel (LayerScale: a scale per channel of every token)",
    "blocks.*.ls_2.*": "sequence-parallel (LayerScale)",
    "blocks.*.ls.*": "sequence-parallel (LayerScale)",
    "blocks.*.q_norm.*": "on each process's heads (QK-norm: one weight for every head)",
    "blocks.*.k_norm.*": "on each process's heads (QK-norm)",
    "blocks.*.attn.proj.bias": "added after the row-wise product's reduce-scatter",
    "blocks.*.ffn.fc2.bias": "added after the row-wise product's reduce-scatter",
    "blocks.*.out_proj.bias": "added after the row-wise product's reduce-scatter",
    "norm.*": "sequence-parallel",
    "attn_pool.*": "the classifier, on the gathered features",
    "fc_norm.*": "the classifier, on the gathered features",
    "pre_logits.*": "the classifier, on the gathered features",
    "head.*": "the classifier, on the gathered features",
}
# Parameters of options the engine x feature rule (pycls.engines.support) refuses under tensor
# parallelism: the feature's name, which the refusal gives
REFUSED = {
    "dist_token": "distillation token",
    "head_dist.*": "distillation token",
}
# Options refused under tensor parallelism that add no parameter of their own name (one that
# changes what a parameter of the standard block's name holds, until the plan splits it): the
# feature, and when the model's arguments (its VitArgs) turn it on. None today
REFUSED_OPTIONS = {}


def placement_of(name):
    """ "sharded", "replicated" or "refused": how the plan places the parameter ``name``; None
    when it does not know it."""
    for placement, patterns in (("sharded", SHARDED), ("replicated", REPLICATED),
                                ("refused", REFUSED)):  # fmt: skip
        if any(fnmatchcase(name, pattern) for pattern in patterns):
            return placement
    return None


def refused_feature(name):
    """The feature whose parameter ``name`` is (``REFUSED``), or None."""
    return next((f for p, f in REFUSED.items() if fnmatchcase(name, p)), None)


def refused_options(args):
    """The features of ``REFUSED_OPTIONS`` the arguments ``args`` (a VitArgs) turn on."""
    return [feature for feature, on in REFUSED_OPTIONS.items() if on(args)]


def check_placed(vit):
    """Raises ValueError naming the parameters of ``vit`` the plan would leave as they are."""
    names = [n for n, _ in vit.named_parameters()]
    refused = {refused_feature(n) for n in names} - {None}
    refused = sorted(refused | set(refused_options(vit.args) if hasattr(vit, "args") else ()))
    if refused:
        raise ValueError(f"tensor parallelism cannot run the {', '.join(refused)}; use the "
                         "engines none, ddp or fsdp")  # fmt: skip
    unknown = [n for n in names if placement_of(n) is None]
    if unknown:
        raise ValueError(
            f"the tensor-parallel plan places no parameter named {', '.join(unknown)}: declare "
            "each sharded or replicated in pycls/models/vit/tensor_plan.py (SHARDED, REPLICATED) "
            "and split or replicate its module in parallelize_vit"
        )


def _check_placements(vit):
    """Each parameter placed as its declaration says (a plan that drifted from it is a bug)."""
    for name, p in vit.named_parameters():
        placements = getattr(p, "placements", None)
        want = placement_of(name)
        if placements is None:
            ok = False
        elif want == "sharded":
            ok = any(pl.is_shard() for pl in placements)
        else:
            ok = all(pl.is_replicate() for pl in placements)
        if not ok:
            raise RuntimeError(f"{name}: declared {want}, placed as {placements}")


# ------------------------------------------------------------------------------------------------ #
# The plan
# ------------------------------------------------------------------------------------------------ #

_NORM_TYPES = tuple(NORMS.values())


def _head_module(block):
    """The module that owns a block's heads (their norms, their rotation)."""
    return block if isinstance(block, ParallelBlock) else block.attn


def _options_plan(block, seq):
    """The styles of what acts on the heads and on the residual branches: the QK-norms, on each
    process's own heads (dimension 1 of (N, heads, L, head_dim): taken as the sharded one, the
    weights replicated, the output local again), and the LayerScales, sequence-parallel on the
    row-wise layers' output."""
    heads = "attn." if isinstance(block, EncoderBlock) else ""
    plan = {}
    for name in ("q_norm", "k_norm"):
        if isinstance(getattr(_head_module(block), name), _NORM_TYPES):
            plan[heads + name] = SequenceParallel(sequence_dim=1, use_local_output=True)
    for name in ("ls_1", "ls_2", "ls"):
        if isinstance(getattr(block, name, None), LayerScale):
            plan[name] = SequenceParallel(sequence_dim=seq)
    return plan


def _sequential_plan(block, seq):
    # the attention's second input is the attention mask of token batches: None here (the engine
    # x feature rule refuses token batches under tensor parallelism); a rotary attention's third,
    # its positions, the same in every process
    extra = (None, None) if block.attn.rope is not None else (None,)
    plan = {
        "ln_1": SequenceParallel(sequence_dim=seq),
        "attn": PrepareModuleInput(
            input_layouts=(Shard(seq), *extra), desired_input_layouts=(Replicate(), *extra)
        ),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(seq), use_local_output=False),
        "ln_2": SequenceParallel(sequence_dim=seq),
        "ffn": PrepareModuleInput(
            input_layouts=(Shard(seq),), desired_input_layouts=(Replicate(),)
        ),
        "ffn.fc2": RowwiseParallel(output_layouts=Shard(seq), use_local_output=False),
    }
    ffn = block.ffn
    for name in ("fc1", "fc1_g", "fc1_x"):
        if hasattr(ffn, name):
            plan[f"ffn.{name}"] = ColwiseParallel()
    if isinstance(ffn, LocalFeedForward):
        plan["ffn.dwconv"] = ChannelParallelDepthwise()
    if isinstance(getattr(ffn, "norm", None), _NORM_TYPES):
        plan["ffn.norm"] = ChannelParallelNorm()
    return {**plan, **_options_plan(block, seq)}


def _parallel_plan(block, seq):
    plan = {
        "in_norm": SequenceParallel(sequence_dim=seq),
        "in_proj": ColwiseParallel(input_layouts=Shard(seq)),  # gathers the sequence shards
        "out_proj": RowwiseParallel(output_layouts=Shard(seq), use_local_output=False),
    }
    return {**plan, **_options_plan(block, seq)}


def _shard_extra_parameters(block, mesh):
    """The parameters a block reads outside a Linear, sharded with their heads or channels, each
    read as this process's part by the method the model reads it with."""
    heads = _head_module(block)
    rope = heads.rope
    if rope is not None and getattr(rope, "freqs", None) is not None:  # (2, heads, pairs)
        shard_parameters(rope, mesh, dim=1)
        rope.head_frequencies = LocalPart(rope, "freqs")
    attn = getattr(block, "attn", None)
    if attn is not None and attn.q_bias is not None:
        shard_parameters(attn, mesh, names=("q_bias", "v_bias"))
        attn.qv_bias = LocalQVBias(attn)
    if getattr(block, "mlp_bias", None) is not None:
        shard_parameters(block, mesh, names=("mlp_bias",))
        block.hidden_bias = LocalPart(block, "mlp_bias")


def _split_block(block, mesh, seq):
    """Tensor and sequence parallelism on one block, in place."""
    tp = mesh.size()
    sequential = isinstance(block, EncoderBlock)
    rowwise = (block.attn.proj, block.ffn.fc2) if sequential else (block.out_proj,)
    for layer in rowwise:  # before the plan's own output hooks
        layer.register_forward_hook(_contiguous_gradient)
    parallelize_module(
        block, mesh, (_sequential_plan if sequential else _parallel_plan)(block, seq)
    )
    gathered = (block.attn, block.ffn) if sequential else (block.in_proj,)
    for module in gathered:  # after the plan's own input hooks
        module.register_forward_pre_hook(_contiguous_input)
    _shard_extra_parameters(block, mesh)
    # the block splits its local columns into the heads (and hidden channels) of this process
    _head_module(block).num_heads //= tp
    if not sequential:
        block.in_split = [size // tp for size in block.in_split]


def _heads_and_hidden(block):
    """A block's heads and the feed-forward's hidden width, which the processes split."""
    if isinstance(block, ParallelBlock):
        return block.num_heads, block.in_split[0]
    return block.attn.num_heads, block.ffn.fc2.in_features


def _replace_random_layers(vit, group):
    """The dropouts that see sequence shards and every DropPath, in their tensor-parallel form."""
    vit.pos_drop = LocalDropout(vit.pos_drop.p)
    for block in vit.blocks:
        if isinstance(block, EncoderBlock):
            block.attn.proj_drop = LocalDropout(block.attn.proj_drop.p)
            ffn = block.ffn
            if isinstance(ffn, LocalFeedForward):
                ffn.drop = LocalDropout(ffn.drop.p)
            else:
                ffn.drop2 = LocalDropout(ffn.drop2.p)
        if isinstance(block.drop_path, DropPath):
            dp = block.drop_path
            block.drop_path = GroupDropPath(dp.p, dp.batch_dim, group)


def parallelize_vit(vit, tp_mesh):
    """Applies tensor and sequence parallelism over ``tp_mesh`` (a 1-D DeviceMesh) to ``vit`` (a
    VisionTransformer, on the meta device or not) in place; returns it. Its fused projections'
    weights must be loaded in the mesh's order afterwards (``FusedLayout``)."""
    check_placed(vit)
    tp = tp_mesh.size()
    check_vit_split(*_heads_and_hidden(vit.blocks[0]), tp)
    frozen = {n for n, p in vit.named_parameters() if not p.requires_grad}  # TRAIN.FREEZE
    seq = 1 if vit.batch_first else 0
    _replace_random_layers(vit, tp_mesh.get_group())
    for block in vit.blocks:
        _split_block(block, tp_mesh, seq)
    # The replicated embedding's tokens are cut into sequence shards before its dropout, and the
    # final norm's output is gathered again for the classifier
    plan = {
        "pos_drop": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(seq),),
            use_local_output=False,
        )
    }
    for name in ("norm_pre", "norm"):
        if isinstance(getattr(vit, name), _NORM_TYPES):
            plan[name] = SequenceParallel(sequence_dim=seq)
    parallelize_module(vit, tp_mesh, plan)
    parallelize_module(
        vit,
        tp_mesh,
        {
            "norm": PrepareModuleOutput(
                output_layouts=(Shard(seq),),
                desired_output_layouts=(Replicate(),),
                use_local_output=False,
            )
        },
    )
    _replicate_root_tensors(vit, tp_mesh)
    distribute_module(vit.patch_embed, **_replicate(tp_mesh))
    for conv in vit.patch_embed.modules():
        if isinstance(conv, nn.Conv2d):
            conv.forward = LocalReplicatedConv(conv)
    if vit.attn_pool is not None:
        vit.attn_pool.attend = LocalReplicatedAttention()
    for module in (vit.attn_pool, vit.fc_norm, vit.pre_logits):
        if module is not None and any(True for _ in module.parameters()):
            distribute_module(module, **_replicate(tp_mesh))
    distribute_module(vit.head, **_replicate(tp_mesh, local_output=True))
    for name, p in vit.named_parameters():  # SequenceParallel makes new, trainable parameters
        p.requires_grad_(name not in frozen)
    _check_placements(vit)
    return vit


# torch 2.10 gathers the uneven sequence shards of a batch-first sequence (17 tokens over 4
# processes) into strided memory, which a linear layer's view then refuses: the input gathered
# for the attention and the feed-forward, and the gradient gathered for the row-parallel layers'
# backward, are made contiguous (on 2.14 they are already, and nothing is copied)


def _contiguous_input(module, args):
    x = args[0]
    if isinstance(x, DTensor) and not x.to_local().is_contiguous():
        return (_contiguous(x), *args[1:])
    return None


def _contiguous_gradient(module, args, output):
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_contiguous)


def _contiguous(t):
    """``t`` (a DTensor) with its local tensor in contiguous memory; None when it is already
    (a tensor hook then keeps the gradient). to_local and from_local carry the gradient."""
    if not isinstance(t, DTensor) or t.to_local().is_contiguous():
        return None
    local = t.to_local().contiguous()
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())  # fmt: skip


def _replicate(mesh, local_output=False):
    """distribute_module's arguments for a replicated module: its parameters and buffers
    replicated, plain inputs taken as replicated, the output a DTensor (or local)."""

    def inputs(module, args, device_mesh):
        return tuple(
            DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def output(module, out, device_mesh):
        # a copy, not the local view: the model's output leaves FSDP2's root unit, which warns
        # about views (an in-place op on one would skip its backward hook)
        return out.to_local().clone() if local_output else out

    return dict(device_mesh=mesh, input_fn=inputs, output_fn=output)


def _replicate_root_tensors(vit, mesh):
    """The class and register tokens and the position embedding (parameters or buffers of the
    model itself, used by its ``embed``) as replicated DTensors; a sin-cos table made for another
    image size too, and the learned table resampled for one: each process resamples its whole
    copy (DTensor of torch 2.10 has no rule for the bicubic resampling; the result is the same)."""
    for name in ("class_token", "register_tokens", "pos_embed"):
        t = getattr(vit, name)
        if t is None:
            continue
        rep = DTensor.from_local(t.data, mesh, [Replicate()], run_check=False)
        if isinstance(t, nn.Parameter):
            vit.register_parameter(name, nn.Parameter(rep, requires_grad=t.requires_grad))
        else:
            vit.register_buffer(name, rep)
    make_table = vit._sincos_table

    def replicated_table(grid):
        table = make_table(grid)
        if isinstance(table, DTensor):
            return table
        return DTensor.from_local(table, mesh, [Replicate()], run_check=False)

    vit._sincos_table = replicated_table

    def resampled_table(grid):
        table = vit.pos_embed
        if not isinstance(table, DTensor):
            return resample_pos_embed(table, grid, num_prefix_tokens=vit.num_prefix_tokens)
        whole = [Replicate()] * table.device_mesh.ndim
        local = table.redistribute(placements=whole).to_local()  # differentiable
        out = resample_pos_embed(local, grid, num_prefix_tokens=vit.num_prefix_tokens)
        return DTensor.from_local(out, table.device_mesh, whole, run_check=False)

    vit._resampled_table = resampled_table


def replicated_parameter_names(vit):
    """The parameters every process of the group holds whole (embedding, tokens, norms,
    classifier: ``REPLICATED``), of a parallelised model."""
    return [n for n, _ in vit.named_parameters() if placement_of(n) == "replicated"]


def partial_gradient_parameters(vit):
    """The replicated parameters whose gradients are partial sums over the group until reduced
    (once per step): those of the layers that see part of the tokens (the sequence-parallel
    norms and LayerScales) or of the heads (the QK-norms)."""
    outside = [vit.norm_pre, vit.norm]
    layers = [m for b in vit.blocks for n, m in b.named_modules() if n != "ffn.norm"]
    return [
        p
        for m in [*outside, *layers]
        if isinstance(m, (*_NORM_TYPES, LayerScale))
        for p in m.parameters(recurse=False)
    ]
