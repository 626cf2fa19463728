"""Re-export shim, kept because users import from it: AMP levels O0-O3 and loss scaling live with
the engines that apply them, in ``pycls.engines.precision`` (the CPU's level in
``pycls.engines.cpu_amp``)."""

from pycls.engines.cpu_amp import cpu_bf16_flags, decide_cpu_level  # noqa: F401  (re-exported)
from pycls.engines.precision import (  # noqa: F401  (re-exported)
    DynamicLossScaler,
    NoLossScaler,
    Precision,
)
