"""Re-export shim, kept because users import from it: AMP levels O0-O3 and loss scaling live with
the engines that apply them, in ``pycls.engines.precision``."""

from pycls.engines.precision import (  # noqa: F401  (re-exported)
    DynamicLossScaler,
    NoLossScaler,
    Precision,
    cpu_bf16_flags,
    precision_from_cfg,
    resolve_cpu_level,
)
