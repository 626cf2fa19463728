"""Tensor and sequence parallelism for the ViT (Megatron-LM's layout, applied with
torch.distributed.tensor.parallel on the model's own submodules): ``parallelize_vit``.

Over the ``tp`` processes of a mesh dimension, each transformer block is split as follows:

- attention: ``qkv`` column-wise (each process computes the queries, keys and values of its
  ``num_heads / tp`` heads), ``proj`` row-wise (each process multiplies its heads' slice, the sum
  is reduce-scattered over the sequence);
- feed-forward: ``fc1`` column-wise, ``fc2`` row-wise (each process holds ``mlp_dim / tp`` hidden
  channels); the local feed-forward's depthwise convolution works channel by channel, so each
  process convolves its own hidden channels;
- LayerNorms, dropouts and the residual stream are sequence-parallel: between the attention and
  the feed-forward each process holds ``1 / tp`` of the tokens (a DTensor sharded on the sequence
  dimension, uneven when the token count is not a multiple of tp, as 197 tokens are).

The patch embedding, the class and register tokens, the position embedding and the classifier are
replicated (cheap next to the blocks): DTensors replicated over the group, which every process
computes on the whole batch; the tokens are cut into sequence shards before the embedding's
dropout and gathered again after the final norm, and the model returns plain logits. Every
parameter is thus a DTensor of the one mesh, as the optimizers' foreach kernels need.

Which parameter is placed how is declared once, by name (``SHARDED``, ``REPLICATED``, and
``REFUSED`` for the parameters of options the engine x feature rule refuses under tensor
parallelism); ``parallelize_vit`` refuses a model with a parameter none of them names, and checks
the placements it made against them. A replicated parameter's gradient is whole in every process:
DTensor sums the partial gradients where each process saw part of the tokens (the sequence-parallel
norms, the row-wise layers' biases) and gathers the sequence shards' gradient before the
replicated embedding, so the copies are equal by construction; the engine then broadcasts them
from the group's first process (``replicated_parameter_names``: the ``REPLICATED`` ones), so that
kernels which are not bitwise deterministic cannot drift the copies apart.

Random layers run on each process's own slice with its own generator (never on a DTensor, whose
random operators would need the generator shared): dropout on its own tokens, attention dropout
on its own heads. Stochastic depth drops whole samples, so every process of the group must drop
the same ones: its mask is drawn by the group's first process and broadcast.

``qkv`` packs the queries, keys and values of all heads ([q | k | v], as nn.MultiheadAttention
does), so a column-wise cut of it would give the first process all queries and the last all
values. Its rows are reordered for the mesh ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...], where q_r are the
queries of process r's heads) before the weights are distributed (``QKVLayout``); every
checkpoint, export and import converts back, so files always hold the model's own layout.
"""

from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor import distribute_tensor as _distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pycls.models.vit.args import check_vit_split
from pycls.models.vit.blocks import DropPath, LocalFeedForward
from pycls.models.vit.position import resample_pos_embed

# ------------------------------------------------------------------------------------------------ #
# Every parameter of the ViT, by how the plan places it (patterns of parameter names, "*" spanning
# dots). A new option's parameters are named here: tests/models/test_parallel_plan.py builds the
# ViT with every option, and parallelize_vit refuses a parameter none names
# ------------------------------------------------------------------------------------------------ #

# Cut over the group: each process holds its slice (its heads, its hidden channels)
SHARDED = {
    "blocks.*.attn.qkv.*": "column-wise, its rows in the mesh's order (QKVLayout)",
    "blocks.*.attn.proj.weight": "row-wise",
    "blocks.*.ffn.fc1.*": "column-wise",
    "blocks.*.ffn.fc2.weight": "row-wise",
    "blocks.*.ffn.dwconv.*": "channel-wise (the local feed-forward's depthwise convolution)",
}
# Held whole by every process, its gradient whole in each (summed over the group where each
# process saw part of the tokens) and broadcast from the group's first process by the engine
REPLICATED = {
    "patch_embed.*": "the stem, on the whole batch",
    "class_token": "the embedding's tokens and table",
    "register_tokens": "the embedding's tokens and table",
    "pos_embed": "the embedding's tokens and table",
    "norm_pre.*": "sequence-parallel: each process normalises its tokens",
    "blocks.*.ln_1.*": "sequence-parallel",
    "blocks.*.ln_2.*": "sequence-parallel",
    "blocks.*.attn.proj.bias": "added after the row-wise product's reduce-scatter",
    "blocks.*.ffn.fc2.bias": "added after the row-wise product's reduce-scatter",
    "norm.*": "sequence-parallel",
    "fc_norm.*": "the classifier, on the gathered features",
    "pre_logits.*": "the classifier, on the gathered features",
    "head.*": "the classifier, on the gathered features",
}
# Parameters of options the engine x feature rule (pycls.engines.support) refuses under tensor
# parallelism: the feature's name, which the refusal gives. The block features' are here until
# the plan splits them (a norm of each head's queries and keys, a LayerScale, the SwiGLU's gate
# rows, the parallel block's fused projections, a mixed RoPE's per-head frequencies)
REFUSED = {
    "dist_token": "distillation token",
    "head_dist.*": "distillation token",
    "blocks.*.q_norm.*": "QK-norm",
    "blocks.*.k_norm.*": "QK-norm",
    "blocks.*.attn.q_norm.*": "QK-norm",
    "blocks.*.attn.k_norm.*": "QK-norm",
    "blocks.*.ls_1.*": "LayerScale",
    "blocks.*.ls_2.*": "LayerScale",
    "blocks.*.ls.*": "LayerScale",
    "blocks.*.ffn.fc1_g.*": "SwiGLU",
    "blocks.*.ffn.fc1_x.*": "SwiGLU",
    "blocks.*.ffn.norm.*": "FFN norm",
    "blocks.*.attn.rope.*": "RoPE",
    "blocks.*.attn.q_bias": "q and v biases",
    "blocks.*.attn.v_bias": "q and v biases",
    "blocks.*.in_norm.*": "parallel blocks",
    "blocks.*.in_proj.*": "parallel blocks",
    "blocks.*.mlp_bias": "parallel blocks",
    "blocks.*.out_proj.*": "parallel blocks",
    "attn_pool.*": "MAP head",
}
# Options refused under tensor parallelism that add no parameter of their own name (a packed
# SwiGLU's fc1 is named as the MLP's, whose column-wise cut would split its gate from its value;
# RMSNorm's weight as LayerNorm's, which the plan makes sequence-parallel by type): the feature,
# and when the model's arguments (its VitArgs) turn it on
REFUSED_OPTIONS = {
    "SwiGLU": lambda a: a.ffn.startswith("swiglu"),
    "RMSNorm": lambda a: a.norm_layer == "rms",
    "RoPE": lambda a: a.rope != "none",
}


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
# The qkv rows in the mesh's order
# ------------------------------------------------------------------------------------------------ #


class QKVLayout:
    """The row order of the ``qkv`` projections under ``tp``-way tensor parallelism.

    The model's order is [q | k | v], each of ``width`` rows (head after head); the mesh's is
    [q_0 k_0 v_0 | ... | q_{tp-1} k_{tp-1} v_{tp-1}], so that the contiguous Shard(0) cut hands
    process r the q, k and v rows of its own heads, in the order the attention splits them.
    Applies to the qkv weight and bias and to every tensor shaped like them (optimizer moments,
    EMA, fp32 masters), keyed by parameter name.
    """

    def __init__(self, names, tp):
        self.names = frozenset(names)
        self.tp = tp

    @classmethod
    def of(cls, vit, tp):
        names = [
            f"blocks.{i}.attn.qkv.{kind}"
            for i, block in enumerate(vit.blocks)
            for kind, p in block.attn.qkv.named_parameters()
            if p is not None
        ]
        return cls(names, tp)

    def _order(self, rows, to_mesh):
        width = rows // 3
        order = torch.arange(rows).view(3, self.tp, width // self.tp).transpose(0, 1).reshape(-1)
        return order if to_mesh else torch.argsort(order)

    def reorder(self, tensor, to_mesh):
        """A full (unsharded) tensor in the mesh's row order (``to_mesh``) or the model's."""
        if self.tp == 1:
            return tensor
        return tensor.index_select(0, self._order(tensor.shape[0], to_mesh).to(tensor.device))

    def reorder_dtensor(self, tensor, to_mesh):
        """A DTensor (any placements) with its rows reordered, distributed as it was: gathered
        whole on every process, reordered, then each process keeps its part."""
        full = self.reorder(tensor.full_tensor(), to_mesh)
        return _distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)

    def convert(self, name, tensor, to_mesh):
        """``tensor`` (full or a DTensor) of parameter ``name`` in the other layout; anything else
        as it is."""
        if self.tp == 1 or name not in self.names or not isinstance(tensor, torch.Tensor):
            return tensor
        if tensor.ndim == 0:  # an optimizer's step count
            return tensor
        if isinstance(tensor, DTensor):
            return self.reorder_dtensor(tensor, to_mesh)
        return self.reorder(tensor, to_mesh)

    def convert_state(self, state, to_mesh):
        """A checkpoint's {"model", "optimizer", "ema"} dicts (optimizer state flattened per
        parameter name: ``state.<name>.<field>``) with the qkv tensors converted."""
        out = dict(state)
        for section in ("model", "ema"):
            if section in state:
                out[section] = {k: self.convert(k, v, to_mesh) for k, v in state[section].items()}
        if "optimizer" in state:
            out["optimizer"] = {
                k: self.convert(_optimizer_param(k), v, to_mesh)
                for k, v in state["optimizer"].items()
            }
        return out


def _optimizer_param(key):
    """The parameter name of a flattened optimizer state key (``state.<name>.<field>``)."""
    if not key.startswith("state."):
        return None
    return key[len("state.") :].rsplit(".", 1)[0]


# ------------------------------------------------------------------------------------------------ #
# Layers under tensor parallelism
# ------------------------------------------------------------------------------------------------ #


class LocalDropout(nn.Module):
    """nn.Dropout on a sequence-sharded DTensor: each process drops its own tokens with its own
    generator (a DTensor's random operators would need one generator shared by the processes).
    Replaces the blocks' and the embedding's nn.Dropout; same ``p``, no parameters."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if not isinstance(x, DTensor):
            return F.dropout(x, self.p, True)
        local = F.dropout(x.to_local(), self.p, True)
        return DTensor.from_local(
            local, x.device_mesh, x.placements, shape=x.shape, stride=x.stride()
        )

    def extra_repr(self):
        return f"p={self.p}"


class GroupDropPath(nn.Module):
    """Stochastic depth under tensor parallelism: the samples to drop are the same in every
    process of the group (each holds a slice of every sample's tokens), drawn by the group's
    first process and broadcast. Replaces DropPath; same ``p`` and ``batch_dim``."""

    def __init__(self, p, batch_dim, group):
        super().__init__()
        self.p, self.batch_dim, self.group = p, batch_dim, group

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        local = x.to_local() if isinstance(x, DTensor) else x
        mask = local.new_empty(local.shape[self.batch_dim]).bernoulli_(keep).div_(keep)
        torch.distributed.broadcast(mask, group=self.group, group_src=0)
        shape = [1] * local.ndim
        shape[self.batch_dim] = -1
        mask = mask.view(shape)
        if isinstance(x, DTensor):
            mask = DTensor.from_local(mask, x.device_mesh, [Replicate()], run_check=False)
        return x * mask

    def extra_repr(self):
        return f"p={self.p}, batch_dim={self.batch_dim}"


class ChannelParallelDepthwise(ParallelStyle):
    """The local feed-forward's depthwise convolution on the hidden channels of this process:
    weight and bias sharded on the channel dimension (Shard(0)), like ``fc1``'s output, and the
    convolution run on the local tensors (a depthwise convolution never mixes channels)."""

    def _apply(self, module, device_mesh):
        def shard(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                dp = _distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None)
                mod.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))

        distribute_module(module, device_mesh, shard)
        module.forward = _LocalDepthwise(module)
        return module


class _LocalDepthwise:
    """The forward of a channel-sharded depthwise Conv2d: this process's channels only."""

    def __init__(self, conv):
        self.conv = conv

    def __call__(self, x):
        c = self.conv
        weight = c.weight.to_local()
        bias = c.bias.to_local() if c.bias is not None else None
        return F.conv2d(x, weight, bias, c.stride, c.padding, c.dilation, groups=weight.shape[0])


class _LocalReplicatedConv:
    """The forward of a replicated convolution (the stem's), run on the local tensors and its
    output a replicated DTensor again. DTensor's own rule for the convolution's backward (torch
    2.10) marks the weight's and bias's gradients partial, as for a batch split over the
    processes, so the processes' identical gradients were summed: tp times too large."""

    def __init__(self, conv):
        self.conv = conv

    def __call__(self, x):
        c = self.conv
        mesh, placements = x.device_mesh, x.placements
        bias = c.bias.to_local() if c.bias is not None else None
        out = F.conv2d(x.to_local(), c.weight.to_local(), bias, c.stride, c.padding, c.dilation,
                       c.groups)  # fmt: skip
        return DTensor.from_local(out, mesh, placements, run_check=False)


# ------------------------------------------------------------------------------------------------ #
# The plan
# ------------------------------------------------------------------------------------------------ #


def _block_plan(block, seq):
    plan = {
        "ln_1": SequenceParallel(sequence_dim=seq),
        # the second input is the attention mask of token batches: None here (the engine x
        # feature rule refuses token batches under tensor parallelism)
        "attn": PrepareModuleInput(
            input_layouts=(Shard(seq), None), desired_input_layouts=(Replicate(), None)
        ),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(seq), use_local_output=False),
        "ln_2": SequenceParallel(sequence_dim=seq),
        "ffn": PrepareModuleInput(
            input_layouts=(Shard(seq),), desired_input_layouts=(Replicate(),)
        ),
        "ffn.fc1": ColwiseParallel(),
        "ffn.fc2": RowwiseParallel(output_layouts=Shard(seq), use_local_output=False),
    }
    if isinstance(block.ffn, LocalFeedForward):
        plan["ffn.dwconv"] = ChannelParallelDepthwise()
    return plan


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


def _replace_random_layers(vit, group):
    """The dropouts that see sequence shards and every DropPath, in their tensor-parallel form."""
    vit.pos_drop = LocalDropout(vit.pos_drop.p)
    for block in vit.blocks:
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
    VisionTransformer, on the meta device or not) in place; returns it. Its qkv weights must be
    loaded in the mesh's row order afterwards (``QKVLayout``)."""
    check_placed(vit)
    tp = tp_mesh.size()
    first = vit.blocks[0]
    check_vit_split(first.attn.num_heads, _mlp_dim(first.ffn), tp)
    frozen = {n for n, p in vit.named_parameters() if not p.requires_grad}  # TRAIN.FREEZE
    seq = 1 if vit.batch_first else 0
    _replace_random_layers(vit, tp_mesh.get_group())
    for block in vit.blocks:
        for rowwise in (block.attn.proj, block.ffn.fc2):  # before the plan's own output hooks
            rowwise.register_forward_hook(_contiguous_gradient)
        parallelize_module(block, tp_mesh, _block_plan(block, seq))
        for gathered in (block.attn, block.ffn):  # after the plan's own input hooks
            gathered.register_forward_pre_hook(_contiguous_input)
        # the attention splits its local columns into the heads of this process
        block.attn.num_heads //= tp
    # The replicated embedding's tokens are cut into sequence shards before its dropout, and the
    # final norm's output is gathered again for the classifier
    plan = {
        "pos_drop": PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(seq),),
            use_local_output=False,
        )
    }
    if isinstance(vit.norm_pre, nn.LayerNorm):
        plan["norm_pre"] = SequenceParallel(sequence_dim=seq)
    if isinstance(vit.norm, nn.LayerNorm):
        plan["norm"] = SequenceParallel(sequence_dim=seq)
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
            conv.forward = _LocalReplicatedConv(conv)
    for module in (vit.fc_norm, vit.pre_logits):
        if module is not None and any(True for _ in module.parameters()):
            distribute_module(module, **_replicate(tp_mesh))
    distribute_module(vit.head, **_replicate(tp_mesh, local_output=True))
    for name, p in vit.named_parameters():  # SequenceParallel makes new, trainable parameters
        p.requires_grad_(name not in frozen)
    _check_placements(vit)
    return vit


def _mlp_dim(ffn):
    return ffn.fc1.out_features


def replicated_parameter_names(vit):
    """The parameters every process of the group holds whole (embedding, tokens, norms,
    classifier: ``REPLICATED``), of a parallelised model."""
    return [n for n, _ in vit.named_parameters() if placement_of(n) == "replicated"]
