"""The ViT's parallel plans, as the engines ask for them (``pycls.models.parallel_plans``): its
pipeline cut (``pipeline_cut``) and its tensor- and sequence-parallel plan (``tensor_plan``). The
engines call these methods on whatever model has a plan, and never name the ViT."""

from torch import nn

from pycls.models.vit.blocks import ParallelBlock
from pycls.models.vit.fused_layout import FusedLayout
from pycls.models.vit.pipeline_cut import ViTChunk, block_ranges
from pycls.models.vit.tensor_plan import (
    parallelize_vit,
    partial_gradient_parameters,
    replicated_parameter_names,
)


class VitParallelPlan:
    """How the engines cut one VisionTransformer over processes."""

    def __init__(self, vit):
        self.model = vit

    # -- pipeline stages ------------------------------------------------------------------- #
    def chunk_ranges(self, num_chunks, balance="blocks"):
        """The blocks of each of ``num_chunks`` pipeline chunks, balanced by block count or by
        parameters (PIPELINE.BALANCE)."""
        return block_ranges(self.model, num_chunks, balance)

    def chunk(self, blocks, first, last):
        """A module that runs ``blocks`` as one pipeline chunk (the embedding too when
        ``first``, the final norm and the head when ``last``), with the model's own submodules
        under their own names; it has ``first``, ``last``, ``blocks`` (a ModuleDict of its blocks
        by index) and ``materialised()``, to call once its tensors are allocated."""
        return ViTChunk(self.model, blocks, first, last)

    def drop_blocks(self):
        """Forgets the model's list of blocks: this process's chunks hold its own, and the blocks
        no chunk holds are freed."""
        self.model.blocks = nn.ModuleList()

    # -- tensor and sequence parallelism --------------------------------------------------- #
    def parallelize_tensors(self, tp_mesh):
        """Applies the tensor- and sequence-parallel plan over ``tp_mesh`` in place."""
        return parallelize_vit(self.model, tp_mesh)

    def replicated_parameter_names(self):
        """The parameters every process of the tensor-parallel group holds whole."""
        return replicated_parameter_names(self.model)

    def checkpoint_layout(self, tp):
        """The order ``tp``-way parallelism gives the fused projections' rows (columns), with
        ``convert_state(state, to_mesh)``: files always hold the model's own order."""
        return FusedLayout.of(self.model, tp)

    @property
    def sequence_dim(self):
        """The token dimension of the activations between blocks."""
        return 1 if self.model.batch_first else 0

    def tokens(self, height, width):
        """Tokens per image of ``height`` x ``width`` pixels (prefix tokens included)."""
        m = self.model
        return m.num_prefix_tokens + (height // m.patch_size) * (width // m.patch_size)

    def traffic_dims(self):
        """The model's numbers in the estimate of the mesh's traffic
        (``pycls.engines.mesh_traffic.TrafficShape``)."""
        m = self.model
        first = m.blocks[0]
        hidden_norm = getattr(getattr(first, "ffn", None), "norm", None)
        return dict(
            depth=len(m.blocks),
            width=m.width,
            tokens=self.tokens(m.image_size, m.image_size),
            pixels=m.arch["in_channels"] * m.image_size**2,
            norm_params=sum(p.numel() for p in partial_gradient_parameters(m)),
            recomputed_blocks=m.checkpoint_blocks,
            sublayers=1 if isinstance(first, ParallelBlock) else 2,
            hidden_norm_values={nn.LayerNorm: 4, nn.RMSNorm: 2}.get(type(hidden_norm), 0),
        )
