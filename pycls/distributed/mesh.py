"""The device meshes: FSDP2's data-parallel mesh (TRAIN.PARALLEL fsdp) and the ``pp x dp x tp``
mesh of TRAIN.PARALLEL tensor, each with its data-parallel processes split into ``replicate x
shard`` (HSDP) where MESH.DP_REPLICATE asks for more than one replica.

Rank ``r`` sits at ``(pp, dp, tp) = (r // (dp * tp), r // tp % dp, r % tp)``: the processes of a
tensor-parallel group are adjacent ranks (the same machine when they fit one, where the
all-gathers and reduce-scatters of every block are cheapest), a pipeline's stages the farthest
apart (they exchange one activation per micro-batch). With replicas, ``dp`` is cut into
``(dp_replicate, dp_shard)`` the same way: a shard group's ranks are adjacent, so that one replica
per machine keeps FSDP2's all-gathers and reduce-scatters within a machine.

Its shape (``mesh_shape``, ``replica_shape``, ``node_replicas``) is plain arithmetic in
``mesh_layout``.
"""

import logging

import torch
from torch.distributed.device_mesh import init_device_mesh

from pycls.distributed import ranks
from pycls.distributed.environments import node_layout
from pycls.distributed.mesh_layout import (
    DIMS,
    HSDP_DIMS,
    divisors,
    mesh_shape,
    node_replicas,
    replica_shape,
)

__all__ = [
    "DIMS",
    "HSDP_DIMS",
    "build_mesh",
    "data_parallel_mesh",
    "divisors",
    "fsdp_mesh",
    "mesh_shape",
    "replicas",
]

logger = logging.getLogger(__name__)


def replicas(setting, dp, tp=1, pp=1):
    """The FSDP2 replicas of ``dp`` data-parallel processes: MESH.DP_REPLICATE ``setting`` where
    it is set (> 0), else one per machine where the launcher says how many (``node_replicas``)
    and every process read the same, else 1. A collective where the processes must agree."""
    if setting > 0:
        return setting
    layout = node_layout()
    guess = node_replicas(dp, tp, pp, *layout) if layout else 1
    if ranks.get_world_size() == 1:
        return guess
    seen = [None] * ranks.get_world_size()
    torch.distributed.all_gather_object(seen, guess)
    if len(set(seen)) > 1:  # machines of different sizes, or numbered differently
        if ranks.is_main_proc():
            logger.warning(
                f"MESH.DP_REPLICATE 0: the processes read different machine layouts from their "
                f"launcher (replicas {sorted(set(seen))}); FSDP2 shards over all {dp} "
                "data-parallel processes instead"
            )
        return 1
    return guess


def data_parallel_mesh(device_type, world, replicate=1):
    """FSDP2's mesh of ``world`` processes: one dimension, or ``(dp_replicate, dp_shard)`` with
    ``replicate`` > 1 replicas (``replicas`` resolves MESH.DP_REPLICATE)."""
    if replicate == 1:
        return init_device_mesh(device_type, (world,))
    shape = replica_shape(world, replicate)
    return init_device_mesh(device_type, shape, mesh_dim_names=HSDP_DIMS[1:3])


def build_mesh(device_type, world, dp=0, tp=1, pp=1, replicate=1):
    """The DeviceMesh of this run's ``world`` processes, named ("pp", "dp", "tp"), or with
    ``replicate`` > 1 replicas ("pp", "dp_replicate", "dp_shard", "tp")."""
    shape = mesh_shape(world, dp, tp, pp)
    if replicate == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    pp, dp, tp = shape
    shape = (pp, *replica_shape(dp, replicate), tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=HSDP_DIMS)


def fsdp_mesh(mesh):
    """The part of ``build_mesh``'s mesh FSDP2 shards over: ``dp``, or ``(dp_replicate,
    dp_shard)``."""
    if "dp" in mesh.mesh_dim_names:
        return mesh["dp"]
    return mesh["dp_replicate", "dp_shard"]
