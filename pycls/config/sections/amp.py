"""AMP: mixed precision (levels O0-O3 in bfloat16 or float16, the type gradients are averaged in,
what a CPU runs) and torchao's float8 linear layers (docs/float8.md). The CPU's level is decided
on the machine that runs (``pycls.config.machine``) and recorded in the config.
"""

from pycls.config.sections.key_checks import CfgNode

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.AMP = CfgNode()

# Precision level: "O0" fp32; "O1" autocast; "O2" half weights (fp32 norms) + fp32 master weights;
# "O3" everything in half precision
_C.AMP.LEVEL = "O0"

# Half-precision type for O1-O3: "bfloat16" or "float16" (float16 uses dynamic loss scaling)
_C.AMP.DTYPE = "bfloat16"

# Type in which the processes average their gradients, the same under every engine: "float32"
# (half gradients are summed in fp32 and rounded once) or "compute" (in AMP.DTYPE: half the
# traffic, a rounding per addition)
_C.AMP.REDUCE_DTYPE = "float32"

# What tools/run_net.py runs on a CPU device: "auto" (AMP.LEVEL as written where AMP.DTYPE is
# bfloat16 and the CPU computes it natively: AMX, AVX512-BF16 or Arm BF16 in /proc/cpuinfo; fp32
# otherwise, where bfloat16 would be emulated), "O0" (fp32 whatever AMP.LEVEL says) or "same"
# (AMP.LEVEL as written). The run says what it decided on stdout; the resolved AMP.LEVEL is in
# OUT_DIR/config.yaml
_C.AMP.CPU_LEVEL = "auto"

# float8 linear layers through torchao (pip install torchao): "none", "tensorwise" (one scale per
# tensor; under FSDP2 the weights are all-gathered in float8) or "rowwise" (one scale per row:
# closer to bfloat16, more casting). Only the linear layers whose in and out features are both at
# least FLOAT8_MIN_DIM (and multiples of 16) are converted, the heads never; the log lists them.
# Needs float8 matmuls (NVIDIA compute capability 8.9+: Ada, Hopper, Blackwell): refused elsewhere.
# Weights and checkpoints stay as they are (fp32, or AMP.LEVEL's half type)
_C.AMP.FLOAT8 = "none"

# The smallest side a linear layer needs to be converted to float8. torchao's H100 microbenchmarks:
# a (1024 x 2048) x (2048 x 1024) matmul runs at 0.80x of bfloat16, a (4096 x 8192) x (8192 x 16384)
# one at 1.39x, so small layers stay in bfloat16; 2048 lies between the two. Every ViT in configs/
# (width 192-1280, MLP 768-5120) is below it: 0 converts all their blocks' layers
# (docs/float8.md)
_C.AMP.FLOAT8_MIN_DIM = 2048


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {
    "AMP.LEVEL": ("O0", "O1", "O2", "O3"),
    "AMP.DTYPE": ("bfloat16", "float16"),
    "AMP.REDUCE_DTYPE": ("float32", "compute"),
    "AMP.CPU_LEVEL": ("auto", "O0", "same"),
    "AMP.FLOAT8": ("none", "tensorwise", "rowwise"),
}
NON_NEGATIVE = ["AMP.FLOAT8_MIN_DIM"]


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {
    "AMP": ("AMP.LEVEL", lambda c: c.AMP.LEVEL != "O0"),
    "float8": ("AMP.FLOAT8", lambda c: c.AMP.FLOAT8 != "none"),
}
