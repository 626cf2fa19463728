"""Who am I among the run's processes, and the reductions the meters and the loop use: rank, world
size, the main process, sums and maxima over processes, a barrier, an object broadcast, and the
torch.device DEVICE names for this process. Alone (no process group) every call is a no-op."""

import torch
import torch.distributed as dist

from pycls.errors import ConfigError


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_initialized() else 1


def is_main_proc():
    """Only the main process writes logs, plots and (unsharded) checkpoints."""
    return get_rank() == 0


def all_reduce_sum(tensors):
    """Sums a list of tensors across processes in place (one call per tensor, no-op alone)."""
    if get_world_size() == 1:
        return tensors
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return tensors


def all_reduce_max(tensor, group=None):
    """The elementwise maximum over the processes of ``group`` (in place; no-op alone)."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def barrier():
    if get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src=0):
    """Sends a picklable object from rank src to every rank."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def resolve_device(name):
    """Maps DEVICE ("auto", "cpu", "cuda") to a torch.device for this process."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("DEVICE: 'cuda' was asked for but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
