"""DISTILL: knowledge distillation from a teacher (DeiT, "Training data-efficient image
transformers & distillation through attention"; docs/distillation.md). The teacher predicts each
training batch (after mixup, in eval mode, under the run's AMP level, without gradients) and the
loss becomes (1 - ALPHA) * the cross-entropy of the class head + ALPHA * the distillation term of
the distillation head (VIT.DIST_TOKEN; without it, of the one head). The teacher is not trained,
saved, averaged (EMA) or sharded: every process holds all of it.
"""

from pycls.config.sections.key_checks import CfgNode, require
from pycls.models.cnn.zoo_table import ZOO

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.DISTILL = CfgNode()

# "none", "hard" (cross-entropy with the teacher's top class) or "soft" (KL divergence from the
# teacher's distribution at temperature TAU, times TAU^2, over batch x classes as DeiT divides)
_C.DISTILL.TYPE = "none"

# The teacher: "zoo:NAME" (a pycls zoo model with its published weights, found in or downloaded
# to MODEL.ZOO_DIR: zoo:RegNetY-16GF is DeiT's teacher family), "timm:NAME" (a timm model, e.g.
# timm:regnety_160, with TEACHER_WEIGHTS), or a pycls checkpoint (a .pyth file, a sharded folder, a
# run folder or a model_final.safetensors: the model is rebuilt from the config stored in it)
_C.DISTILL.TEACHER = ""

# A weights file for the teacher: required for timm:NAME (a state dict, possibly under "model",
# as DeiT's regnety_160-a5fe301d.pth), optional for zoo:NAME (instead of the published file)
_C.DISTILL.TEACHER_WEIGHTS = ""

# Weight of the distillation term, in [0, 1] (DeiT: 0.5)
_C.DISTILL.ALPHA = 0.5

# Temperature of soft distillation (DeiT: 1.0)
_C.DISTILL.TAU = 1.0

# A run records its teacher (DISTILL.TEACHER and the SHA-256 of its weights file or folder) in
# every checkpoint; a resume whose teacher's weights differ is refused, naming both. True: resume
# with the new teacher, the change logged
_C.DISTILL.ALLOW_TEACHER_CHANGE = False


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
CHOICES = {"DISTILL.TYPE": ("none", "hard", "soft")}
POSITIVE = ["DISTILL.TAU"]
FRACTIONS = ["DISTILL.ALPHA"]

# DISTILL.TEACHER's prefixes: a zoo model, a timm model; anything else is a pycls checkpoint
TEACHER_ZOO, TEACHER_TIMM = "zoo:", "timm:"


def check(c):
    d = c.DISTILL
    if d.TYPE == "none":
        return
    require(d.TEACHER != "", "DISTILL.TEACHER", f"DISTILL.TYPE {d.TYPE} needs a teacher")
    if d.TEACHER.startswith(TEACHER_ZOO):
        name = d.TEACHER[len(TEACHER_ZOO) :]
        require(name in ZOO, "DISTILL.TEACHER", f"{name!r} is not in the zoo; one of {list(ZOO)}")
    if d.TEACHER.startswith(TEACHER_TIMM):
        require(
            d.TEACHER_WEIGHTS != "",
            "DISTILL.TEACHER_WEIGHTS",
            f"the timm teacher {d.TEACHER[len(TEACHER_TIMM) :]} needs its weights file",
        )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support)
# ------------------------------------------------------------------------------------------------ #
FEATURES = {"distillation": ("DISTILL.TYPE", lambda c: c.DISTILL.TYPE != "none")}
