"""``LaunchSettings``: what starting a run's processes needs to know, as plain values, each
option declared once (``pycls.options.option``): the config's DEVICE, NUM_PROCS and CPU_THREADS
keys are generated from these fields (``pycls.config.sections.engine``), the rest read from the
engine's keys. ``pycls.distributed.preflight.check_launch`` checks them against the machine.
Plain Python, no torch: the config reads the values here.
"""

from dataclasses import dataclass

from pycls.options import Key, ReadFrom, option

DEVICES = ("auto", "cpu", "cuda")
# The keys that name the engine (``engine_of``'s arguments, in order)
ENGINE_OF_KEYS = ("TRAIN.PARALLEL", "FSDP.BACKEND")


def engine_of(parallel, fsdp_backend):
    """The engine TRAIN.PARALLEL and FSDP.BACKEND select (a key of
    ``pycls.engines.support.ENGINES``): TRAIN.PARALLEL's value, but for fsdp on FairScale."""
    return "fairscale" if parallel == "fsdp" and fsdp_backend == "fairscale" else parallel


def _cpu_collectives(parallel, fsdp_backend, cpu_offload):
    return engine_of(parallel, fsdp_backend) in ("fsdp", "tensor") and cpu_offload


@dataclass(frozen=True)
class LaunchSettings:
    """What starting a run's processes needs to know: how many local processes, their CPU
    threads, the device, and the engine's needs (gloo beside NCCL for FSDP2's CPU offload; the
    pipeline's cut, the mesh and FSDP2's replicas, checked against the processes)."""

    num_procs: int = option(
        1, "Number of local processes to spawn (1 = this process only)", bounds="positive"
    )
    cpu_threads: int = option(
        0,
        "CPU threads of each process (torch.set_num_threads). 0 = automatic: OMP_NUM_THREADS if "
        "set, else a SLURM task's SLURM_CPUS_PER_TASK, else for a process started beside others "
        "(torchrun, srun, NUM_PROCS) the CPUs of its affinity mask divided by the processes on "
        "the machine; a plain single process keeps torch's default (one thread per core)",
        bounds="non_negative",
    )
    device: str = option(
        "cpu",
        "Device: auto (cuda when available, else cpu), cpu or cuda",
        choices=DEVICES,
        key=Key(default="auto", why="auto: the machine that runs decides (pycls.config.machine)"),
    )
    engine: str = option(
        "none",
        "The engine (a key of pycls.engines.support.ENGINES)",
        key=ReadFrom(*ENGINE_OF_KEYS, read=engine_of),
    )
    cpu_collectives: bool = option(
        False,
        "gloo beside NCCL, for FSDP2's shards kept on the host",
        key=ReadFrom(*ENGINE_OF_KEYS, "FSDP.CPU_OFFLOAD", read=_cpu_collectives),
    )
    depth: int = option(0, "The ViT's blocks, which the pipeline's stages share",
                        key=ReadFrom("VIT.DEPTH"))  # fmt: skip
    train_batch_size: int = option(1, "Training batch", key=ReadFrom("TRAIN.BATCH_SIZE"))
    test_batch_size: int = option(1, "Evaluation batch", key=ReadFrom("TEST.BATCH_SIZE"))
    accum_steps: int = option(1, "Micro-batches per step", key=ReadFrom("TRAIN.ACCUM_STEPS"))
    pipeline_stages: int = option(1, "Pipeline stages", key=ReadFrom("PIPELINE.STAGES"))
    pipeline_stages_per_rank: int = option(
        1, "Chunks per pipeline rank", key=ReadFrom("PIPELINE.STAGES_PER_RANK")
    )
    pipeline_micro_batches: int = option(
        1, "Pipeline micro-batches", key=ReadFrom("PIPELINE.MICRO_BATCHES")
    )
    pipeline_schedule: str = option("1f1b", "Pipeline schedule", key=ReadFrom("PIPELINE.SCHEDULE"))
    mesh_dp: int = option(0, "The mesh's data-parallel replicas", key=ReadFrom("MESH.DP"))
    mesh_dp_replicate: int = option(0, "FSDP2's replicas", key=ReadFrom("MESH.DP_REPLICATE"))
    mesh_tp: int = option(1, "Tensor-parallel processes", key=ReadFrom("MESH.TP"))
    mesh_pp: int = option(1, "The mesh's pipeline stages", key=ReadFrom("MESH.PP"))
