"""AMP: mixed precision (levels O0-O3 in bfloat16 or float16, the type gradients are averaged in,
the ViT's residual stream under O1, what a CPU runs) and torchao's float8 linear layers and which
of them (docs/float8.md). The CPU's level is decided on the machine that runs
(``pycls.config.machine``) and recorded in the config.
"""

from pycls.config.sections.key_checks import CfgNode, require
from pycls.models.vit.args import RESIDUAL_DTYPES

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

# The ViT's residual stream (the tokens between its blocks) under AMP.LEVEL O1: "float32" (as O1
# computes it: the float32 position embedding makes the stream float32) or "bfloat16" (the embedded
# tokens cast before the first block, so every block adds its branches in bfloat16, as O2 has it,
# with float32 weights and optimizer; a quarter fewer bytes per block). O1 with AMP.DTYPE bfloat16
# only: O2 and O3 already have a half stream. Under FSDP2 (fsdp, tensor) O1's stream is bfloat16
# already, since FSDP2's mixed precision casts every block's input (docs/recipes.md). A CPU that
# runs AMP.LEVEL O1 as O0 (AMP.CPU_LEVEL) runs the stream in float32 too, and records it
_C.AMP.RESIDUAL_DTYPE = "float32"

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

# Which of the layers FLOAT8_MIN_DIM allows are converted (FLOAT8_MIN_DIM filters first, then this
# key picks among what is left): "all" (every one: what ran before the key existed), "mlp" (each
# block's ffn.fc1 and ffn.fc2 only) or "auto" (where a roofline of the float8 matmul's saving
# against its casts' memory traffic, at one process's micro-batch x tokens rows, expects a gain;
# its constants are H100 estimates, pycls.engines.float8.float8_gain). "mlp" and "auto" act on
# the ViT's blocks; set FLOAT8_MIN_DIM 0 to let them choose among all of them (docs/float8.md)
_C.AMP.FLOAT8_LAYERS = "all"


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {
    "AMP.LEVEL": ("O0", "O1", "O2", "O3"),
    "AMP.DTYPE": ("bfloat16", "float16"),
    "AMP.REDUCE_DTYPE": ("float32", "compute"),
    "AMP.RESIDUAL_DTYPE": RESIDUAL_DTYPES,
    "AMP.CPU_LEVEL": ("auto", "O0", "same"),
    "AMP.FLOAT8": ("none", "tensorwise", "rowwise"),
    "AMP.FLOAT8_LAYERS": ("all", "mlp", "auto"),
}
NON_NEGATIVE = ["AMP.FLOAT8_MIN_DIM"]


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
    "AMP": ("AMP.LEVEL", lambda c: c.AMP.LEVEL != "O0"),
    "float8": ("AMP.FLOAT8", lambda c: c.AMP.FLOAT8 != "none"),
    "bfloat16 residual": ("AMP.RESIDUAL_DTYPE", lambda c: c.AMP.RESIDUAL_DTYPE != "float32"),
}
