"""What a config means on this machine, decided once while it loads, so that the config a run
records (OUT_DIR/config.yaml, every checkpoint) is the config that ran:

- ``DEVICE auto`` becomes ``cpu`` or ``cuda``;
- on a CPU device, ``AMP.CPU_LEVEL`` decides the AMP level (``pycls.engines.cpu_amp``: measured
  where bfloat16 could be kept); the level that runs is written to AMP.LEVEL and CPU_LEVEL
  becomes ``same``, each change said in a note (and AMP.RESIDUAL_DTYPE becomes float32 where the
  level becomes O0).
"""

import torch

from pycls import distributed as dist
from pycls.engines import cpu_amp


def resolve(c):
    """Resolves ``c`` (unfrozen) for this machine in place; returns the notes to show."""
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
