"""AMP levels O0-O3 and loss scaling, where pycls users look for them; they live with the engines
that apply them (``pycls.engines.precision``)."""

from pycls.engines.precision import (  # noqa: F401  (re-exported)
    DynamicLossScaler,
    NoLossScaler,
    Precision,
    cpu_bf16_flags,
    precision_from_cfg,
    resolve_cpu_level,
)
