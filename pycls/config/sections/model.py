"""MODEL: which model a run trains (its family, or a named ViT preset), its classes and loss, and
where the zoo's published weights are kept. The families' own keys are their sections':
``model_vit`` (VIT) and ``model_cnn`` (upstream pycls's CNN families).
"""

from pycls.config.sections.key_checks import CfgNode, require

__all__ = ["CHOICES", "FAMILIES", "POSITIVE", "check"]

# ------------------------------------------------------------------------------------------------ #
# The keys: each with its default and, above it, what it means
# ------------------------------------------------------------------------------------------------ #
_C = CfgNode()
_C.MODEL = CfgNode()

# Model family: "vit", or upstream pycls's convolutional families "anynet", "regnet", "resnet",
# "effnet" (their keys: the model_cnn section)
_C.MODEL.TYPE = "vit"

# A named variant from pycls.models.vit.variants (vit_ti16 ... vit_h14) whose sizes replace the
# defaults of VIT.PATCH_SIZE, VIT.DEPTH, VIT.WIDTH, VIT.NUM_HEADS and VIT.MLP_DIM. A VIT key written
# explicitly (in the YAML file or as KEY VALUE) wins over the preset: "--cfg vit_ti16.yaml
# VIT.DEPTH 6" is a 6-block ViT-Ti. "" means no preset: the VIT keys as written, else their
# defaults (ViT-B/16 sizes: the model_vit section)
_C.MODEL.ARCH = ""

# Number of output classes
_C.MODEL.NUM_CLASSES = 1000

# Loss function: "cross_entropy" (softmax, with TRAIN.LABEL_SMOOTHING) or "binary_cross_entropy"
# (a sigmoid per class, DeiT III's and timm's BCE: the targets smoothed by TRAIN.LABEL_SMOOTHING,
# then binarised at BCE_TARGET_THRESHOLD; the mean over images x classes)
_C.MODEL.LOSS_FUN = "cross_entropy"

# binary_cross_entropy: targets above this value become 1, the others 0. DeiT III's 0.0 makes both
# classes of a mixed (mixup, cutmix) image 1; a negative value keeps the targets as they are
# (mixup's weights: timm's BinaryCrossEntropy without target_threshold). In [0, 1) it must lie
# between TRAIN.LABEL_SMOOTHING / NUM_CLASSES (the smoothed zeros) and the smoothed ones
_C.MODEL.BCE_TARGET_THRESHOLD = 0.0

# Folder of the model zoo's published weights, read by TRAIN.WEIGHTS / TEST.WEIGHTS
# "zoo:NAME" (e.g. zoo:RegNetY-800MF; the CNNs of pycls.models.list_models()): the file is taken
# from here if present, else downloaded here. "" = the PYCLS_ZOO_DIR environment variable, else
# ~/.cache/pycls/zoo. Offline, the error names the URL and the path to put the file at
_C.MODEL.ZOO_DIR = ""


# ------------------------------------------------------------------------------------------------ #
# Checks
# ------------------------------------------------------------------------------------------------ #
# The model families MODEL.TYPE names (their argument tables: model_vit.VIT_ARGS, model_cnn's)
FAMILIES = ("vit", "anynet", "regnet", "resnet", "effnet")

CHOICES = {
    "MODEL.TYPE": FAMILIES,
    "MODEL.LOSS_FUN": ("cross_entropy", "binary_cross_entropy"),
}
POSITIVE = ["MODEL.NUM_CLASSES"]


def check(c):
    threshold, smoothing = c.MODEL.BCE_TARGET_THRESHOLD, c.TRAIN.LABEL_SMOOTHING
    if c.MODEL.LOSS_FUN != "binary_cross_entropy" or threshold < 0:
        return
    zero = smoothing / c.MODEL.NUM_CLASSES  # a smoothed 0 and 1: the threshold must part them
    one = 1.0 - smoothing + zero
    require(
        zero <= threshold < one,
        "MODEL.BCE_TARGET_THRESHOLD",
        f"{threshold} does not part the smoothed targets (TRAIN.LABEL_SMOOTHING {smoothing} over "
        f"{c.MODEL.NUM_CLASSES} classes: 0 becomes {zero:.4g}, 1 becomes {one:.4g}): every "
        "target would be 1, or none; use a value in between, or a negative one (soft targets)",
    )
