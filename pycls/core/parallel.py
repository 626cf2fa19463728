"""Former home of the parallel engines, now pycls.engines (kept for old import paths)."""

from pycls.engines import ENGINES, needs_cpu_collectives, parallelize
from pycls.engines.check import check_cfg

__all__ = ["ENGINES", "check_cfg", "needs_cpu_collectives", "parallelize"]
