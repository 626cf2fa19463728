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
    indexed by the same channels, and its statistics summed over the group. A LayerNorm
    all-reduces one value per token for the mean and one for the variance, an RMSNorm one for the
    mean square, in float32: a few bytes per token where gathering the hidden activations would
    move all of them, and the row-wise ``fc2`` after it takes the sharded output as it is. The
    module keeps its type and its parameters' names (checkpoints, AMP O2's float32 norms)."""

    def _apply(self, module, device_mesh):
        distribute_module(module, device_mesh, lambda n, m, mesh: shard_parameters(m, mesh))
        module.forward = _ChannelShardedNorm(module, device_mesh)
        return module


class _ChannelShardedNorm:
    """The forward of a norm over hidden channels this process holds a slice of: the two-pass
    statistics of ``F.layer_norm`` (or ``F.rms_norm``'s mean square) in float32, over the whole
    hidden width, through DTensor's sums (their Partial results all-reduced, and the backward's
    as well); the output in the input's dtype."""

    def __init__(self, norm, mesh):
        self.norm, self.mesh = norm, mesh

    def __call__(self, x):
        n, whole = self.norm, [Replicate()]
        width = n.normalized_shape[-1]
        eps = n.eps if n.eps is not None else torch.finfo(x.dtype).eps
        h = DTensor.from_local(x.float(), self.mesh, [Shard(x.ndim - 1)], run_check=False)
        if isinstance(n, nn.LayerNorm):
            h = h - h.sum(-1, keepdim=True).redistribute(placements=whole) / width
        mean_square = (h * h).sum(-1, keepdim=True).redistribute(placements=whole) / width
        h = h * torch.rsqrt(mean_square + eps)
        if n.weight is not None:
            h = h * n.weight.float()
        if getattr(n, "bias", None) is not None:
            h = h + n.bias.float()
        return h.to_local().to(x.dtype)


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
