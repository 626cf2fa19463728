"""The fused projections of the ViT's blocks in the order tensor parallelism keeps their rows
(columns): ``FusedLayout``, which every checkpoint, export and import of the tensor-parallel
engines converts through, so that files hold the model's own order (``pycls.models.vit.tensor_plan``
splits the layers)."""

import itertools

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import distribute_tensor as _distribute_tensor

from pycls.models.vit.blocks import ParallelBlock
from pycls.models.vit.feed_forward import PackedSwiGLU


def fused_projections(block):
    """(module name in the block, dimension, sizes of its parts) of each fused projection of
    ``block``, from the layers' own sizes (which the plan leaves as they are)."""
    if isinstance(block, ParallelBlock):
        width = block.out_proj.out_features
        mlp = block.in_proj.out_features - 3 * width
        return [("in_proj", 0, (mlp, width, width, width)), ("out_proj", 1, (width, mlp))]
    width = block.attn.qkv.in_features
    fused = [("attn.qkv", 0, (width, width, width))]
    if isinstance(block.ffn, PackedSwiGLU):
        hidden = block.ffn.fc2.in_features
        fused.append(("ffn.fc1", 0, (hidden, hidden)))
    return fused


class FusedLayout:
    """The order of the fused projections' rows (or columns) under ``tp``-way tensor parallelism.

    ``parts``: {parameter name: (dimension, the sizes of its parts along it)}. The model's order
    is the parts one after the other, [q | k | v]; the mesh's interleaves them process by
    process, [q_0 k_0 v_0 | ... | q_{tp-1} k_{tp-1} v_{tp-1}] (q_r: the r-th of tp equal slices of
    q), so that the contiguous Shard cut hands process r the matching slice of every part, in
    the order the layer splits its output (or its input, for ``out_proj``'s columns). Applies to
    the parameters and to every tensor shaped like them (optimizer moments, EMA, fp32 masters),
    keyed by parameter name; a parameter the dimension does not reach (``out_proj``'s bias) is
    left out.
    """

    def __init__(self, parts, tp):
        self.parts = dict(parts)
        self.tp = tp

    @property
    def names(self):
        return frozenset(self.parts)

    @classmethod
    def of(cls, vit, tp):
        parts = {}
        for i, block in enumerate(vit.blocks):
            for module_name, dim, sizes in fused_projections(block):
                module = block.get_submodule(module_name)
                for kind, p in module.named_parameters():
                    if p is not None and p.ndim > dim:
                        parts[f"blocks.{i}.{module_name}.{kind}"] = (dim, sizes)
        return cls(parts, tp)

    def order(self, name, to_mesh):
        """The index along the parameter's dimension that takes the model's order to the
        mesh's (``to_mesh``) or back."""
        _, sizes = self.parts[name]
        starts = [0, *itertools.accumulate(sizes)]
        order = torch.cat([
            torch.arange(start + r * (size // self.tp), start + (r + 1) * (size // self.tp))
            for r in range(self.tp)
            for start, size in zip(starts, sizes)
        ])  # fmt: skip
        return order if to_mesh else torch.argsort(order)

    def reorder(self, name, tensor, to_mesh):
        """A full (unsharded) tensor of parameter ``name`` in the mesh's order (``to_mesh``) or
        the model's."""
        if self.tp == 1:
            return tensor
        dim = self.parts[name][0]
        return tensor.index_select(dim, self.order(name, to_mesh).to(tensor.device))

    def reorder_dtensor(self, name, tensor, to_mesh):
        """A DTensor (any placements) reordered, distributed as it was: gathered whole on every
        process, reordered, then each process keeps its part."""
        full = self.reorder(name, tensor.full_tensor(), to_mesh)
        return _distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)

    def convert(self, name, tensor, to_mesh):
        """``tensor`` (full or a DTensor) of parameter ``name`` in the other layout; anything else
        as it is."""
        if self.tp == 1 or name not in self.parts or not isinstance(tensor, torch.Tensor):
            return tensor
        if tensor.ndim == 0:  # an optimizer's step count
            return tensor
        if isinstance(tensor, DTensor):
            return self.reorder_dtensor(name, tensor, to_mesh)
        return self.reorder(name, tensor, to_mesh)

    def convert_state(self, state, to_mesh):
        """A checkpoint's {"model", "optimizer", "ema"} dicts (optimizer state flattened per
        parameter name: ``state.<name>.<field>``) with the fused tensors converted."""
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


# The older name, from when the qkv projection was the only fused one
QKVLayout = FusedLayout


def _optimizer_param(key):
    """The parameter name of a flattened optimizer state key (``state.<name>.<field>``)."""
    if not key.startswith("state."):
        return None
    return key[len("state.") :].rsplit(".", 1)[0]


def _optimizer_param(key):
    """The parameter name of a flattened optimizer state key (``state.<name>.<field>``)."""
    if not key.startswith("state."):
        return None
    return key[len("state.") :].rsplit(".", 1)[0]
