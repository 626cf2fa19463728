"""Model builders: each model family built from the arguments its config section's table gives
(``FAMILIES``: MODEL.TYPE -> the class and ``model_vit.VIT_ARGS`` or ``model_cnn``'s table, from
which the keys that shape a model are derived), models rebuilt from checkpoints, and the
distillation teacher. Part of the builders (``pycls.core.builders``, whose face names them).
"""

import math
import os

import torch

from pycls import config
from pycls import distributed as dist
from pycls.checkpoint import file_digest, opened_weights, weight_files
from pycls.checkpoint.files import CheckpointError
from pycls.config import ConfigError
from pycls.config.sections import model_cnn, model_vit
from pycls.config.sections.distill import TEACHER_TIMM, TEACHER_ZOO
from pycls.config.sections.key_checks import keys_read
from pycls.config.sections.train import ZOO_PREFIX
from pycls.core import logging as logs
from pycls.core.distillation import Teacher
from pycls.errors import UserError
from pycls.models import zoo
from pycls.models.cnn.anynet import AnyNet
from pycls.models.cnn.effnet import EffNet
from pycls.models.cnn.regnet import RegNet
from pycls.models.cnn.resnet import ResNet
from pycls.models.vit import VisionTransformer

logger = logs.get_logger(__name__)

# ------------------------------------------------------------------------------------------------ #
# Models: each family's constructor arguments, one line each, read from the config
# ------------------------------------------------------------------------------------------------ #


# MODEL.TYPE -> (the model class, its argument table)
FAMILIES = {
    "vit": (VisionTransformer, model_vit.VIT_ARGS),
    "anynet": (AnyNet, model_cnn.ANYNET_ARGS),
    "regnet": (RegNet, model_cnn.REGNET_ARGS),
    "resnet": (ResNet, model_cnn.RESNET_ARGS),
    "effnet": (EffNet, model_cnn.EFFNET_ARGS),
}


def model_kwargs(cfg, family=None):
    """The constructor arguments of the model family MODEL.TYPE (or ``family``) that cfg
    describes."""
    _, table = FAMILIES[family or cfg.MODEL.TYPE]
    return {arg: read(cfg) for arg, read in table.items()}


def vit_kwargs(cfg, image_size=None):
    """The VisionTransformer arguments that cfg describes (at ``image_size`` if given)."""
    kwargs = model_kwargs(cfg, "vit")
    return {**kwargs, "image_size": image_size or kwargs["image_size"]}


def build_model(cfg, image_size=None):
    """The model MODEL.TYPE names, on the CPU in fp32 (the trainer moves and casts it), at
    ``image_size`` (default TRAIN.IM_SIZE)."""
    cls, _ = FAMILIES[cfg.MODEL.TYPE]
    if cls is VisionTransformer:
        return VisionTransformer(**vit_kwargs(cfg, image_size))
    model = cls(**model_kwargs(cfg))
    # A CNN takes any image size; it records the one it is built for (complexity, engines)
    model.set_image_size(image_size or cfg.TRAIN.IM_SIZE)
    return model


def model_keys(cfg, before=None):
    """The config keys that shape the model MODEL.TYPE names: those its argument table reads for
    every argument but the model class's TRAINING_ONLY_ARGS (a checkpoint resumes under other
    values of those). Derived from the table that builds the model, never listed by hand.

    With ``before`` (a config of the same MODEL.TYPE), only the keys of the arguments whose values
    differ between the two: a key whose change leaves every argument as it was (VIT.CLASS_TOKEN
    under the token classifier, which always has one) shapes nothing."""
    cls, table = FAMILIES[cfg.MODEL.TYPE]
    keys = {"MODEL.TYPE"}
    for arg, read in table.items():
        if arg in cls.TRAINING_ONLY_ARGS:
            continue
        if before is not None and read(before) == read(cfg):
            continue
        keys |= keys_read(read, cfg) | (keys_read(read, before) if before is not None else set())
    return sorted(keys)


def weights_file(cfg, key):
    """The file that TRAIN.WEIGHTS or TEST.WEIGHTS (``key``) names: the path as written, or for
    "zoo:NAME" the published weights of the zoo model NAME, from MODEL.ZOO_DIR (else
    $PYCLS_ZOO_DIR, else ~/.cache/pycls/zoo) or downloaded there."""
    path = cfg.TRAIN.WEIGHTS if key == "TRAIN.WEIGHTS" else cfg.TEST.WEIGHTS
    if not path.startswith(ZOO_PREFIX):
        return path
    try:
        return zoo.fetch_weights(path[len(ZOO_PREFIX) :], cfg.MODEL.ZOO_DIR or None)
    except (ValueError, zoo.PretrainedWeightsUnavailable) as e:
        raise ConfigError(f"{key}: {e}") from None


def channels_last(cfg, device):
    """Whether MODEL.MEMORY_FORMAT puts this run's CNN and its batches in channels_last."""
    fmt = cfg.MODEL.MEMORY_FORMAT
    if cfg.MODEL.TYPE == "vit" or fmt == "contiguous":
        return False
    if fmt == "channels_last":
        return True
    device = dist.resolve_device(cfg.DEVICE) if device is None else torch.device(device)
    return device.type == "cuda" and cfg.TRAIN.PARALLEL in ("none", "ddp")


def memory_format(model, cfg, device):
    """The model in the memory format MODEL.MEMORY_FORMAT gives (in place; returns it)."""
    if channels_last(cfg, device):
        model.to(memory_format=torch.channels_last)
    return model


# ------------------------------------------------------------------------------------------------ #
# Models from checkpoints, and the distillation teacher
# ------------------------------------------------------------------------------------------------ #


def model_from_checkpoint(path: str):
    """(model, cfg) from a pycls checkpoint file or folder, or a pycls safetensors file (the
    model built from the config stored inside, with the stored weights, once the file is seen to
    hold that model: ``check_claimed_model``). A run folder or its checkpoints/ folder stands for
    its newest checkpoint."""
    return model_from_opened(opened_weights.open_weights(path, "checkpoint"))


def model_from_opened(opened):
    """(model, cfg) from an opened weights file of a kind that holds pycls's config
    (``opened_weights.WITH_CONFIG``), by the reader its kind chose."""
    if opened.kind not in opened_weights.WITH_CONFIG or not opened.cfg_text:
        if opened.refused:  # a .pyth that is no (readable, intact) pycls checkpoint
            raise CheckpointError(opened.refused)
        raise weight_files.WeightsError(
            f"{opened.path} holds no pycls config ({opened.kind}); cannot rebuild its model"
        )
    cfg = config.cfg_from_yaml_text(opened.cfg_text, f"{opened.path}: its stored config")
    check_claimed_model(opened.path, cfg, dict(opened.shapes))
    model = build_model(cfg)
    opened.load_into(model)
    return model.eval(), cfg


def _claimed_blocks(cfg):
    """The blocks the config's model has, from its keys alone; each holds at least one tensor
    (a ResNet's depth is looked up in a table, so it bounds itself)."""
    family = cfg.MODEL.TYPE
    if family == "vit":
        return cfg.VIT.DEPTH
    if family == "regnet":
        return cfg.REGNET.DEPTH
    if family == "anynet":
        return sum(cfg.ANYNET.DEPTHS)
    if family == "effnet":
        return sum(cfg.EN.DEPTHS)
    return 0


def check_claimed_model(path, cfg, shapes):
    """Raises WeightsError unless the model that ``cfg`` (a config stored in ``path``) describes
    fits in the tensors the file holds (``shapes``: name -> shape, read from its headers): its
    blocks at most the file's tensors, its values at most the file's. The model is counted on
    the meta device (no storage), so a few-KB file whose config claims billions of parameters
    is refused before they are allocated."""
    held = sum(math.prod(shape) for shape in shapes.values())
    where = f"{path}: its stored config describes"
    if _claimed_blocks(cfg) > len(shapes):
        raise weight_files.WeightsError(
            f"{where} {_claimed_blocks(cfg)} blocks; the file holds {len(shapes)} tensors "
            "(a config that does not belong to these weights, or a crafted file)"
        )
    with torch.device("meta"):
        claimed = build_model(cfg)
    needed = sum(t.numel() for t in claimed.state_dict().values())
    if needed > held:
        raise weight_files.WeightsError(
            f"{where} a model of {needed:,} values; the file holds {held:,} "
            "(a config that does not belong to these weights, or a crafted file): nothing built"
        )


def _timm_teacher(name, opened, num_classes):
    """A timm model with a weights file (a state dict, possibly under "model"), as DeiT loads
    its RegNetY-160 teacher."""
    import timm  # optional: only timm teachers need it

    try:
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    except RuntimeError as e:  # timm's "Unknown model"
        raise ConfigError(f"DISTILL.TEACHER: timm:{name}: {e}") from None
    return opened.load_exactly(model, f"timm:{name}")


def build_teacher_module(cfg):
    """The network DISTILL.TEACHER names, with its weights, on the CPU in fp32."""
    return teacher_module_and_file(cfg)[0]


def teacher_module_and_file(cfg):
    """(the teacher network, its weights file or folder, opened: ``opened_weights``, which
    decided what the file is and reads it)."""
    d = cfg.DISTILL
    source, weights = d.TEACHER, d.TEACHER_WEIGHTS
    try:
        if source.startswith(TEACHER_ZOO):
            name = source[len(TEACHER_ZOO) :]
            model = zoo.build_model(name)
            key = "DISTILL.TEACHER_WEIGHTS" if weights else "DISTILL.TEACHER"
            path = weights or zoo.fetch_weights(name, cfg.MODEL.ZOO_DIR or None)
            opened = opened_weights.open_weights(path, key)
            return opened.load_exactly(model, source), opened
        if source.startswith(TEACHER_TIMM):
            opened = opened_weights.open_weights(weights, "DISTILL.TEACHER_WEIGHTS")
            name = source[len(TEACHER_TIMM) :]
            return _timm_teacher(name, opened, cfg.MODEL.NUM_CLASSES), opened
        if not os.path.exists(source):
            raise ConfigError(
                f"DISTILL.TEACHER: {source} does not exist (a pycls checkpoint, or zoo:NAME, "
                "timm:NAME)"
            )
        opened = opened_weights.open_weights(source, "DISTILL.TEACHER")
        return model_from_opened(opened)[0], opened
    except weight_files.WeightsError:
        raise  # a file that is no weights: its line names the key already, as the run's reads do
    except (UserError, ValueError, zoo.PretrainedWeightsUnavailable) as e:
        # not a checkpoint, no config inside, weights that do not fit, an unknown zoo name
        raise ConfigError(_named(e, "DISTILL.TEACHER")) from None


def _named(error, key):
    """``error``'s line, starting with the key that named the file (once)."""
    line = str(error)
    return line if line.startswith("DISTILL.TEACHER") else f"{key}: {line}"


def teacher_identity(cfg, path):
    """What a run records of its teacher: DISTILL.TEACHER and the SHA-256 of the file (or
    folder) its weights came from (cached by size and modification time)."""
    return {"teacher": cfg.DISTILL.TEACHER, "file": path, "sha256": file_digest.digest(path)}


def build_teacher(cfg, device, precision):
    """The Teacher DISTILL describes: every process holds all of it on ``device``, cast for the
    AMP level (``precision``), compiled with TRAIN.COMPILE."""
    module, opened = teacher_module_and_file(cfg)
    identity = opened.identity(cfg.DISTILL.TEACHER)
    classes = getattr(module, "num_classes", None)
    if classes != cfg.MODEL.NUM_CLASSES:
        raise ConfigError(
            f"DISTILL.TEACHER: {cfg.DISTILL.TEACHER} predicts {classes} classes, the model "
            f"MODEL.NUM_CLASSES={cfg.MODEL.NUM_CLASSES}"
        )
    millions = sum(p.numel() for p in module.parameters()) / 1e6
    heads = "the distillation head" if cfg.VIT.DIST_TOKEN else "the one head (no VIT.DIST_TOKEN)"
    logger.info(
        f"distilling ({cfg.DISTILL.TYPE}, alpha {cfg.DISTILL.ALPHA}) from {cfg.DISTILL.TEACHER} "
        f"({type(module).__name__}, {millions:.1f} M parameters) into {heads}; every process "
        f"holds the whole teacher, in eval mode; its weights: {opened.path} (sha256 "
        f"{identity['sha256']})"
    )
    return Teacher(module, device, precision, compile=cfg.TRAIN.COMPILE, identity=identity)
