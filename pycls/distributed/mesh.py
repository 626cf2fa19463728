"""The device mesh of TRAIN.PARALLEL tensor: ``pp x dp x tp`` processes.

Rank ``r`` sits at ``(pp, dp, tp) = (r // (dp * tp), r // tp % dp, r % tp)``: the processes of a
tensor-parallel group are adjacent ranks (the same machine when they fit one, where the
all-gathers and reduce-scatters of every block are cheapest), a pipeline's stages the farthest
apart (they exchange one activation per micro-batch).

Its shape (``mesh_shape``) is plain arithmetic in ``mesh_layout``.
"""

from torch.distributed.device_mesh import init_device_mesh

from pycls.distributed.mesh_layout import DIMS, divisors, mesh_shape

__all__ = ["DIMS", "build_mesh", "divisors", "mesh_shape"]


def build_mesh(device_type, world, dp=0, tp=1, pp=1):
    """The DeviceMesh named ("pp", "dp", "tp") of this run's ``world`` processes."""
    shape = mesh_shape(world, dp, tp, pp)
    return init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
