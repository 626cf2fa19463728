"""The shape of the device mesh of TRAIN.PARALLEL tensor: ``pp x dp x tp`` processes (where each
rank sits: ``pycls.distributed.mesh``). Plain arithmetic, no torch: the config check asks it too.

``mesh_shape`` resolves MESH.DP 0 (the processes left over) and refuses a mesh whose product is not
the number of processes, naming the key and the values that would fit.
"""

from pycls.errors import ConfigError

DIMS = ("pp", "dp", "tp")


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
