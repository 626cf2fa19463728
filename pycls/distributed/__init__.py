"""Where a run's processes come from and how they work together; one module per job, every name
also here (``from pycls import distributed as dist; dist.get_rank()``):

- ``ranks``: who am I (rank, world size, the main process), reductions of meters, DEVICE as a
  torch.device;
- ``environments``: the processes a launcher started (torchrun exports RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT; SLURM's srun one task per process with SLURM_PROCID,
  SLURM_NTASKS and SLURM_LOCALID, the master being the first host of the step's node list), and
  the CPU threads each process should use; reads the environment only;
- ``process_groups``: joining the process group (``init_process_group``: NCCL on CUDA, gloo on
  the CPU; NCCL's flight recorder on), a group of one process, a side group for a background
  thread's collectives, the exit of a process that had one;
- ``preemption``: stop signals turned into a checkpoint at a step every process agrees on;
- ``watchdog``: a hung run found and named (a thread per process, talking through the
  rendezvous store), and stop signals honoured while the loop is blocked in a collective;
- ``mesh``, ``mesh_layout``: the device mesh of TRAIN.PARALLEL tensor and its shape;
- ``launch``: one process, ``NUM_PROCS G`` local ones (spawned here), torchrun's or srun's;
- ``preflight``: what the processes need from the machine (``launch_settings``: a plain record
  of it), checked before any starts.

The rest of pycls only asks ``get_rank()`` / ``get_world_size()`` / ``is_main_proc()``.
"""

from typing import TYPE_CHECKING

from pycls.package_faces import install_face

# The face (pycls.package_faces): each name imports its module on first use, so that the config's
# torch-free reads of mesh_layout, environments and launch_settings cost no torch
if TYPE_CHECKING:
    from pycls.distributed.environments import (
        ProcessEnv,
        agent_store_advice,
        available_cpus,
        cpu_threads,
        first_slurm_host,
        launcher_env,
        local_world_size,
        node_layout,
        parse_first_host,
        restarts_share_agent_store,
        slurm_env,
        torchrun_env,
    )
    from pycls.distributed.preemption import (
        INTERRUPTED_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        PREEMPTION_SIGNALS,
        Preempted,
        PreemptionFlag,
        stop_at,
        stop_pending,
    )
    from pycls.distributed.process_groups import (
        ENVIRONMENT_ERROR_KEY,
        FLIGHT_RECORDER,
        USER_ERROR_KEY,
        destroy_process_group,
        exit_process,
        groups_joined,
        init_process_group,
        init_single_process_group,
        set_cpu_threads,
        side_group,
        store_address,
        wants_cuda,
    )
    from pycls.distributed.ranks import (
        all_reduce_max,
        all_reduce_sum,
        barrier,
        broadcast_object,
        get_rank,
        get_world_size,
        is_initialized,
        is_main_proc,
        resolve_device,
    )
    from pycls.distributed.watchdog import NO_WATCHDOG, Watchdog, start_watchdog
    from pycls.errors import ConfigError

install_face(__name__)
