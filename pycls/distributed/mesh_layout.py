"""The shape of the device meshes: ``pp x dp x tp`` processes of TRAIN.PARALLEL tensor, and the
split of the data-parallel processes into ``replicate x shard`` (HSDP: FSDP2 shards within a group
of ``shard`` processes and the ``replicate`` groups average their gradients). Where each rank sits:
``pycls.distributed.mesh``. Plain arithmetic, no torch: the config check asks it too.

``mesh_shape`` resolves MESH.DP 0 (the processes left over) and refuses a mesh whose product is not
the number of processes, naming the key and the values that would fit; ``replica_shape`` does the
same for MESH.DP_REPLICATE, and ``node_replicas`` is its default: one replica per machine.
"""

from pycls.errors import ConfigError

DIMS = ("pp", "dp", "tp")
# With replicas: FSDP2 shards over ``dp_shard`` and replicates over ``dp_replicate``
HSDP_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shape(world, dp=0, tp=1, pp=1):
    """``(pp, dp, tp)`` for ``world`` processes (``dp`` 0: the rest); ConfigError naming the key
    and the values that would fit when they do not multiply to ``world``."""
    if world % pp:
        raise ConfigError(
            f"MESH.PP: {pp} does not divide the {world} processes; values that do: "
            f"{divisors(world)}"
        )
    per_stage = world // pp
    if per_stage % tp:
        where = f"{world} processes" if pp == 1 else f"{per_stage} processes of each stage"
        raise ConfigError(
            f"MESH.TP: {tp} does not divide the {where}; values that do: {divisors(per_stage)}"
        )
    rest = per_stage // tp
    if dp not in (0, rest):
        raise ConfigError(
            f"MESH.DP: {dp} x MESH.TP {tp} x MESH.PP {pp} = {dp * tp * pp} processes, but the run "
            f"has {world}: set MESH.DP {rest} (or 0, the processes left over)"
        )
    return pp, rest, tp


def replica_shape(dp, replicate):
    """``(replicate, shard)`` of ``dp`` data-parallel processes; ConfigError naming
    MESH.DP_REPLICATE and the values that would fit when ``replicate`` does not divide them."""
    if dp % replicate:
        raise ConfigError(
            f"MESH.DP_REPLICATE: {replicate} replicas do not divide the {dp} data-parallel "
            f"processes; values that do: {divisors(dp)} (or 0: one replica per machine)"
        )
    return replicate, dp // replicate


def node_replicas(dp, tp=1, pp=1, nodes=None, per_node=None):
    """MESH.DP_REPLICATE 0: one FSDP2 replica per machine, so that every all-gather and
    reduce-scatter stays within a machine and only the replicas' gradient all-reduce crosses
    machines. That needs ``nodes`` machines of ``per_node`` processes each, the ranks of a
    machine consecutive (as torchrun and srun's block distribution number them), whole
    tensor-parallel groups on each and no pipeline stages (whose replicas run no FSDP2); else 1
    (FSDP2 shards over every data-parallel process)."""
    if not nodes or nodes <= 1 or pp > 1 or nodes * per_node != dp * tp * pp:
        return 1
    if per_node % tp:  # a tensor-parallel group would span machines
        return 1
    return nodes
