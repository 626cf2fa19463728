"""AMP: mixed precision (levels O0-O3 in bfloat16 or float16, the type gradients are averaged in,
the ViT's residual stream under O1, what a CPU runs) and torchao's float8 linear layers and which
of them (docs/float8.md). What the keys become: the AMP level's settings (``AMP_SETTINGS``,
``pycls.engines.settings.AmpSettings``) and EngineSettings's reduction type and float8 layers
(``engine.ENGINE_SETTINGS``), whose fields the keys are generated from. The CPU's level is
decided on the machine that runs (``pycls.config.machine``) and recorded in the config.
"""

from pycls.config.records import RecordKeys, joined
from pycls.config.sections.engine import ENGINE_RECORD
from pycls.config.sections.key_checks import require
from pycls.config.sections.model_vit import VIT_RECORD
from pycls.engines.settings import AmpSettings

# ------------------------------------------------------------------------------------------------ #
# The keys: AMP.LEVEL and DTYPE generated from the fields of the AMP level's record (AmpSettings),
# REDUCE_DTYPE and the float8 keys from EngineSettings's (pycls.engines.settings), RESIDUAL_DTYPE
# from VitArgs's, each with its default, its meaning and its values; the one the machine step
# alone reads by hand below
# ------------------------------------------------------------------------------------------------ #
AMP_RECORD = RecordKeys(AmpSettings, "AMP", home="amp")
_KEYS = joined(AMP_RECORD.section("amp"), ENGINE_RECORD.section("amp"), VIT_RECORD.section("amp"))
_C = _KEYS.tree
# The generated keys' reference texts (a hand-written key has its comment above it)
REFERENCE = _KEYS.reference

# What tools/run_net.py runs on a CPU device: "auto" (AMP.LEVEL as written where AMP.DTYPE is
# bfloat16 and the CPU computes it natively: AMX, AVX512-BF16 or Arm BF16 in /proc/cpuinfo; fp32
# otherwise, where bfloat16 would be emulated), "O0" (fp32 whatever AMP.LEVEL says) or "same"
# (AMP.LEVEL as written). The run says what it decided on stdout; the resolved AMP.LEVEL is in
# OUT_DIR/config.yaml
_C.AMP.CPU_LEVEL = "auto"


# ------------------------------------------------------------------------------------------------ #
# Checks: the value tables (from the fields' choices and bounds) and the combinations
# ------------------------------------------------------------------------------------------------ #
CHOICES = {
    **_KEYS.choices,
    "AMP.CPU_LEVEL": ("auto", "O0", "same"),
}
NON_NEGATIVE = _KEYS.non_negative


def check(c):
    """AMP.RESIDUAL_DTYPE is O1's, in bfloat16, for a ViT; AMP.FLOAT8_LAYERS needs AMP.FLOAT8."""
    _check_residual_dtype(c)
    a = c.AMP
    require(
        a.FLOAT8_LAYERS == "all" or a.FLOAT8 != "none",
        "AMP.FLOAT8_LAYERS",
        f"{a.FLOAT8_LAYERS} picks among the float8 layers, and AMP.FLOAT8 is none; set AMP.FLOAT8 "
        "tensorwise or rowwise",
    )


def _check_residual_dtype(c):
    a = c.AMP
    if a.RESIDUAL_DTYPE == "float32":
        return
    key = "AMP.RESIDUAL_DTYPE"
    require(c.MODEL.TYPE == "vit", key, f"{a.RESIDUAL_DTYPE} is the ViT's residual stream; "
            f"MODEL.TYPE {c.MODEL.TYPE} has none (its blocks end in batch norms)")  # fmt: skip
    require(
        a.LEVEL not in ("O2", "O3"),
        key,
        f"AMP.LEVEL {a.LEVEL} already runs the residual stream in {a.DTYPE} (its weights are "
        "half); the key is for O1",
    )
    require(
        a.LEVEL == "O1",
        key,
        f"{a.RESIDUAL_DTYPE} needs autocast (AMP.LEVEL O1); AMP.LEVEL O0 computes in float32",
    )
    require(
        a.DTYPE == "bfloat16",
        key,
        f"{a.RESIDUAL_DTYPE} with AMP.DTYPE float16 is untested (float16's range, loss scaling); "
        "use AMP.DTYPE bfloat16",
    )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    **_KEYS.features,
    "bfloat16 residual": ("AMP.RESIDUAL_DTYPE", lambda c: c.AMP.RESIDUAL_DTYPE != "float32"),
}


# ------------------------------------------------------------------------------------------------ #
# What the keys become: pycls.engines.settings.AmpSettings (the Precision the builders make of it),
# one row per argument, generated from its fields (AMP's part of EngineSettings: the engine section)
# ------------------------------------------------------------------------------------------------ #
AMP_SETTINGS = AMP_RECORD.arguments
