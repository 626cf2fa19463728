"""What a config means on this machine, decided once while it loads, so that the config a run
records (OUT_DIR/config.yaml, every checkpoint) is the config that ran:

- ``DEVICE auto`` becomes ``cpu`` or ``cuda``;
- on a CPU device, ``AMP.CPU_LEVEL`` decides the AMP level (``pycls.engines.cpu_amp``: measured
  where bfloat16 could be kept); the level that runs is written to AMP.LEVEL and CPU_LEVEL
  becomes ``same``, each change said in a note (and AMP.RESIDUAL_DTYPE becomes float32 where the
  level becomes O0).
"""

import os

import torch

from pycls import distributed as dist
from pycls.engines import cpu_amp
from pycls.errors import require

# The least an epoch's order takes per sample: one int64 index
_ORDER_BYTES = 8


def memory_bytes():
    """This machine's memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n):
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e6:.3g} MB"


def check_sizes(c, memory=None):
    """Values whose size must fit this machine's memory (``memory`` bytes, default this
    machine's): one micro-batch of TRAIN.TOKEN_BUDGET's patches as the float pixels the model
    takes (each process's share: the launcher's processes, else NUM_PROCS), and a shuffle buffer
    no larger than the largest split whose epoch order (8 bytes a sample) could be held."""
    memory = memory or memory_bytes()
    if not memory:
        return
    t, p = c.TRAIN, c.VIT.PATCH_SIZE
    env = dist.launcher_env()
    shares = (env.world_size if env is not None else max(c.NUM_PROCS, 1)) * t.ACCUM_STEPS
    pixels = t.TOKEN_BUDGET / shares * p * p * 3 * 4
    require(
        pixels <= memory,
        "TRAIN.TOKEN_BUDGET",
        f"{t.TOKEN_BUDGET} patch tokens per step, in micro-batches of {t.TOKEN_BUDGET / shares:.3g}"
        f" ({shares} = processes x TRAIN.ACCUM_STEPS), are pixels that alone take "
        f"{_size(pixels)} a micro-batch as the model reads them ({p}x{p}x3 float32 a patch), "
        f"more than this machine's {_size(memory)} of memory",
    )
    largest = memory // _ORDER_BYTES
    require(
        largest >= c.DATA_LOADER.SHUFFLE_BUFFER,
        "DATA_LOADER.SHUFFLE_BUFFER",
        f"{c.DATA_LOADER.SHUFFLE_BUFFER} samples: more than any split this machine can order "
        f"(an epoch's order takes {_ORDER_BYTES} bytes a sample, {_size(memory)} of memory hold "
        f"{largest:.3g}); a buffer as large as the split is already a full shuffle",
    )


def resolve(c):
    """Resolves ``c`` (unfrozen) for this machine in place; returns the notes to show."""
    check_sizes(c)
    notes = []
    if c.DEVICE == "auto":
        c.DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    if c.DEVICE == "cpu":
        # Processes that load the config on their own (torchrun, srun) must agree: a
        # measurement could differ between them, the CPU's flags cannot
        measure = cpu_amp.measure_cpu_bf16 if dist.launcher_env() is None else None
        level, note = cpu_amp.decide_cpu_level(c.AMP.LEVEL, c.AMP.DTYPE, c.AMP.CPU_LEVEL, measure)
        if note:
            notes.append(note)
        if level != c.AMP.LEVEL or c.AMP.CPU_LEVEL != "same":
            c.AMP.LEVEL, c.AMP.CPU_LEVEL = level, "same"
        if level == "O0" and c.AMP.RESIDUAL_DTYPE != "float32":
            # a bfloat16 stream is part of O1's autocast, which this CPU does not run
            dtype = c.AMP.RESIDUAL_DTYPE
            notes.append(f"AMP.RESIDUAL_DTYPE {dtype} runs as float32 (AMP.LEVEL O0)")
            c.AMP.RESIDUAL_DTYPE = "float32"
    return notes
