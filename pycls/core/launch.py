"""Starting the processes of a run: one process, or NUM_PROCS local ones, or torchrun / SLURM's."""

import os


def launch(fn, mode, cfg):
    """Runs fn(mode, cfg) in this process (multi-process launch arrives with pycls.core.parallel)."""
    if cfg.NUM_PROCS > 1 or "WORLD_SIZE" in os.environ:
        raise NotImplementedError("multi-process runs are not available in this build")
    return fn(mode, cfg)
