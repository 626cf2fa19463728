"""The ViT's layers as tensor parallelism runs them (the plan that installs them:
``pycls.models.vit.tensor_plan``): random layers on each process's own slice, the depthwise
convolution and the hidden norm on each process's own channels, the replicated stem's convolution
on local tensors, and each process's part of the parameters the blocks read outside a Linear (EVA's
q and v biases, the parallel block's MLP bias, a mixed RoPE's frequencies).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor import distribute_tensor as _distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


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


def shard_parameters(module, mesh, dim=0, names=None):
    """``module``'s own parameters (those called ``names``, or all) as DTensors sharded on
    ``dim`` over ``mesh``, in place: each process keeps its slice."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p is not None and (names is None or name in names):
            dp = _distribute_tensor(p, mesh, [Shard(dim)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dp, requires_grad=p.requires_grad))


class ChannelParallelDepthwise(ParallelStyle):
    """The local feed-forward's depthwise convolution on the hidden channels of this process:
    weight and bias sharded on the channel dimension (Shard(0)), like ``fc1``'s output, and the
    convolution run on the local tensors (a depthwise convolution never mixes channels)."""

    def _apply(self, module, device_mesh):
        distribute_module(module, device_mesh, lambda n, m, mesh: shard_parameters(m, mesh))
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


class ChannelParallelNorm(ParallelStyle):
    """A norm of the feed-forward's hidden activations (EVA-02's sub-LN, ``ffn_norm``), whose
    channels the column-wise ``fc1`` shards: its weight and bias sharded with them (Shard(0)), as
    indexed by the same channels, and its statistics summed over the group (``HiddenNorm``): a
    few float32 values per token where gathering the hidden activations would move all of them,
    and the row-wise ``fc2`` after it takes the sharded output as it is. The module keeps its
    type and its parameters' names (checkpoints, AMP O2's float32 norms)."""

    def _apply(self, module, device_mesh):
        distribute_module(module, device_mesh, lambda n, m, mesh: shard_parameters(m, mesh))
        module.forward = _ChannelShardedNorm(module, device_mesh.get_group())
        return module


class _ChannelShardedNorm:
    """The forward of a norm over hidden channels this process holds a slice of."""

    def __init__(self, norm, group):
        self.norm, self.group = norm, group

    def __call__(self, x):
        n = self.norm
        eps = n.eps if n.eps is not None else torch.finfo(x.dtype).eps
        bias = getattr(n, "bias", None)
        return HiddenNorm.apply(
            x, n.weight.to_local(), None if bias is None else bias.to_local(), eps,
            n.normalized_shape[-1], self.group, isinstance(n, nn.LayerNorm),
        )  # fmt: skip


def _group_sum(t, group):
    """``t`` summed over the processes of ``group`` (a new tensor)."""
    t = t.contiguous()
    torch.distributed.all_reduce(t, group=group)
    return t


class HiddenNorm(torch.autograd.Function):
    """LayerNorm (``centred``) or RMSNorm over a width ``width`` of channels that the processes of
    ``group`` hold slices of (the last dimension of ``x``), in float32 at least, the output in
    ``x``'s dtype; ``weight`` and ``bias``: this process's slices (or None).

    The statistics are sums over the whole width, all-reduced: forward the mean and the mean
    square of the centred values (two passes, as ``F.layer_norm``; RMSNorm the mean square
    alone), backward the means of ``dy * weight`` and of its product with the normalised input
    (RMSNorm the latter alone), one all-reduce of both. Per token: 4 values for a LayerNorm, 2 for
    an RMSNorm. The weight's and bias's gradients are this process's channels' own.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, width, group, centred):
        exact = torch.promote_types(x.dtype, torch.float32)
        h = x.to(exact)
        if centred:
            h = h - _group_sum(h.sum(-1, keepdim=True), group) / width
        rstd = torch.rsqrt(_group_sum((h * h).sum(-1, keepdim=True), group) / width + eps)
        normed = h * rstd
        out = normed if weight is None else normed * weight.to(exact)
        if bias is not None:
            out = out + bias.to(exact)
        ctx.save_for_backward(normed, rstd, weight)
        ctx.group, ctx.width, ctx.centred, ctx.has_bias = group, width, centred, bias is not None
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        normed, rstd, weight = ctx.saved_tensors
        dy = dy.to(normed.dtype)
        g = dy if weight is None else dy * weight.to(normed.dtype)
        sums = [(g * normed).sum(-1, keepdim=True)]
        if ctx.centred:
            sums.append(g.sum(-1, keepdim=True))
        means = _group_sum(torch.cat(sums, dim=-1), ctx.group) / ctx.width
        dx = g - normed * means[..., :1]
        if ctx.centred:
            dx = dx - means[..., 1:]
        dx = (dx * rstd).to(ctx.dtypes[0])
        rows = tuple(range(dy.ndim - 1))
        dw = None if weight is None else (dy * normed).sum(rows).to(weight.dtype)
        db = dy.sum(rows).to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx, dw, db, None, None, None, None


class LocalReplicatedConv:
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


# The parameters a block reads outside a Linear, sharded with the heads or hidden channels they
# belong to: each process reads its own part through the method the model reads them with


class LocalPart:
    """``module.<name>``'s local part (a DTensor parameter's slice of this process)."""

    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self):
        return getattr(self.module, self.name).to_local()


class LocalQVBias:
    """An attention's [q_bias | 0 | v_bias] for the local columns of its qkv product, which are
    [q | k | v] of this process's heads (``tensor_plan.FusedLayout``)."""

    def __init__(self, attn):
        self.attn = attn

    def __call__(self):
        q, v = self.attn.q_bias.to_local(), self.attn.v_bias.to_local()
        return torch.cat([q, torch.zeros_like(q), v])


class LocalReplicatedAttention:
    """SDPA of replicated DTensors on each process's whole local copies, its output replicated
    again (the attention pool's: DTensor has no rule for SDPA's backward on the CPU). Each
    process computes the same gradients, which stay replicated."""

    def __call__(self, q, k, v):
        mesh, placements = q.device_mesh, q.placements
        out = F.scaled_dot_product_attention(q.to_local(), k.to_local(), v.to_local())
        return DTensor.from_local(out, mesh, placements, run_check=False)
