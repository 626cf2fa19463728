"""What the training loop advises, fitted to the run's config and this machine: what to try when
the loss diverges (never the AMP level the run already has), and that the step waited for its
batches (said once per run, with advice for the worker count, the backend and the cores this
machine gives each process, never "add workers" to a run whose cores all run the step).
"""

import logging

import torch

from pycls import distributed as dist

logger = logging.getLogger(__name__)

# The share of an epoch's wall time the step may wait for batches before the log calls the
# training loader-bound
LOADER_BOUND = 0.10


def _either(tries):
    return ", ".join(tries[:-1]) + f" or {tries[-1]}" if len(tries) > 1 else tries[0]


def divergence_advice(cfg):
    """What to try after the loss became inf or NaN, for this run's settings: an AMP change only
    where one would keep more in float32 (O2/O3 -> O1) or widen float16's range (bfloat16)."""
    o, amp = cfg.OPTIM, cfg.AMP
    tries = ["a lower OPTIM.BASE_LR"]
    if o.WARMUP_EPOCHS < o.MAX_EPOCH:
        tries.append("longer OPTIM.WARMUP_EPOCHS")
    tries.append(f"a smaller OPTIM.CLIP_GRAD (now {o.CLIP_GRAD:g})" if o.CLIP_GRAD > 0 else
                 "OPTIM.CLIP_GRAD")  # fmt: skip
    if amp.LEVEL in ("O2", "O3"):
        tries.append("AMP.LEVEL O1 (float32 weights)")
    elif amp.LEVEL == "O1" and amp.DTYPE == "float16":
        tries.append("AMP.DTYPE bfloat16")
    return f"Try {_either(tries)}"


def processes_here():
    """The run's processes on this machine (a launcher's, else those NUM_PROCS spawned)."""
    return dist.local_world_size() if dist.launcher_env() is not None else dist.get_world_size()


def loader_advice(cfg, cores, step_threads, processes=1):
    """What would feed a loader-bound step faster, for this config on a machine of ``cores``
    cores shared by ``processes`` training processes, each running its step on
    ``step_threads`` threads (1 on a GPU: the host only drives it)."""
    dl, cuda = cfg.DATA_LOADER, cfg.DEVICE == "cuda"
    idle = cores - processes * (step_threads + dl.NUM_WORKERS)
    faster = [] if dl.BACKEND == "shards" else ["prepared shards (DATA_LOADER.BACKEND shards)"]
    faster += ["augmentation on the GPU (DATA_LOADER.AUGMENT_DEVICE)"] if cuda else []
    faster += ["a faster store"] if dl.BACKEND in ("wds", "parquet") else []
    others = f"; {_either(faster)} would load for less" if faster else ""
    if dl.NUM_WORKERS == 0:
        said = ("DATA_LOADER.NUM_WORKERS 0 loads each batch in the training process between "
                "steps, so this is loading's part of each step, not a stall")  # fmt: skip
        if idle < processes:
            return (f"{said}; this machine's {cores} cores all run the step, so workers would "
                    f"take turns with it{others}")  # fmt: skip
        return (f"{said}; the run leaves {idle} of this machine's {cores} cores unused: "
                f"DATA_LOADER.NUM_WORKERS {idle // processes} would load beside the step, which "
                f"pays where a batch costs more to load than to hand over{others}")  # fmt: skip
    if idle >= processes:
        more = dl.NUM_WORKERS + idle // processes
        return (f"the run leaves {idle} of this machine's {cores} cores unused: "
                f"DATA_LOADER.NUM_WORKERS {more} would use them{others}")  # fmt: skip
    return (f"its {dl.NUM_WORKERS} worker(s) and the step use all {cores} cores of this machine"
            f"{others or '; the loader is as fast as this machine makes it'}")  # fmt: skip


class LoaderBoundNotice:
    """Says once per run, after the first epoch whose step waited for its batches more than
    LOADER_BOUND of its time, that training went at the loader's pace, with ``loader_advice``
    (each epoch's share stays in its train_epoch line: ``data_wait_share``)."""

    def __init__(self, cfg):
        self.cfg, self.said = cfg, False

    def epoch_done(self, share, epoch):
        if self.said or share <= LOADER_BOUND:
            return
        self.said = True
        threads = 1 if self.cfg.DEVICE == "cuda" else torch.get_num_threads()
        advice = loader_advice(self.cfg, dist.available_cpus(), threads, processes_here())
        logger.info(
            f"epoch {epoch + 1} was loader-bound: the training step waited for the next batch "
            f"{share:.0%} of the time (DATA_LOADER.BACKEND {self.cfg.DATA_LOADER.BACKEND}): "
            f"{advice} (said once; each epoch's share is its train_epoch's data_wait_share; "
            'docs/data.md, "Which one limits: model or loader")'
        )
