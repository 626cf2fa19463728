"""--mode scale: a CNN config scaled by MODEL.SCALING_TYPE and MODEL.SCALING_FACTOR.

As upstream pycls's ``--mode scale``: a RegNet becomes the AnyNet with its stages, AnyNet and
EfficientNet stage lists are scaled (pycls.models.cnn.model_scaling), the image sizes follow the
resolution factor; the scaled config is written to OUT_DIR/CFG_DEST and the complexity is logged
before and after.
"""

import torch

from pycls import config
from pycls.core import builders
from pycls.core import logging as logs
from pycls.errors import ConfigError
from pycls.models.cnn import model_scaling
from pycls.models.cnn.regnet import regnet_to_anynet

logger = logs.get_logger(__name__)

FAMILIES = ("anynet", "regnet", "effnet")


def _regnet_as_anynet(c):
    r, a = c.REGNET, c.ANYNET
    args = dict(w_a=r.WA, w_0=r.W0, w_m=r.WM, depth=r.DEPTH, group_w=r.GROUP_W, bot_mul=r.BOT_MUL)
    stages = regnet_to_anynet(**args, stride=r.STRIDE)
    for key in ("STEM_TYPE", "STEM_W", "BLOCK_TYPE", "HEAD_W", "SE_ON", "SE_R"):
        a[key] = r[key]
    for key in ("DEPTHS", "WIDTHS", "STRIDES", "BOT_MULS", "GROUP_WS"):
        a[key] = list(stages[key.lower()])
    c.MODEL.TYPE = "anynet"


def scale_cfg(cfg):
    """A new, validated config of the scaled model (MODEL.SCALING_* reset: it is the model)."""
    if cfg.MODEL.TYPE not in FAMILIES:
        raise ConfigError(f"MODEL.TYPE: --mode scale scales {list(FAMILIES)}, not {cfg.MODEL.TYPE}")
    c = cfg.clone()
    c.defrost()
    scale_keys(c)
    c.MODEL.SCALING_TYPE, c.MODEL.SCALING_FACTOR = "", 1.0
    config.assert_cfg(c)
    return c


def scale_keys(c):
    """Scales the model keys of the tree ``c`` in place by its MODEL.SCALING_* (upstream's rule)."""
    try:
        d, w, g, r = model_scaling.scaling_factors(c.MODEL.SCALING_TYPE, c.MODEL.SCALING_FACTOR)
    except ValueError as e:
        raise ConfigError(f"MODEL.SCALING_TYPE: {e}") from None
    if c.MODEL.TYPE == "regnet":
        _regnet_as_anynet(c)
    if c.MODEL.TYPE == "anynet":
        a = c.ANYNET
        lists = model_scaling.scale_stages(a.DEPTHS, a.WIDTHS, a.BOT_MULS, a.GROUP_WS, d, w, g)
        a.DEPTHS, a.WIDTHS, a.BOT_MULS, a.GROUP_WS = lists
    else:
        e = c.EN
        sizes = model_scaling.scale_effnet(
            e.STEM_W, e.DEPTHS, e.WIDTHS, e.EXP_RATIOS, e.HEAD_W, d, w
        )
        e.STEM_W, e.DEPTHS, e.WIDTHS, e.EXP_RATIOS, e.HEAD_W = sizes
    for split in (c.TRAIN, c.TEST):
        split.IM_SIZE = model_scaling.scale_image_size(split.IM_SIZE, r)


def complexity(cfg):
    with torch.device("meta"):  # shapes only: allocate nothing
        model = builders.build_model(cfg)
    return model.complexity(cfg.TRAIN.IM_SIZE)


def scale_model(cfg):
    """Writes the scaled config to OUT_DIR/CFG_DEST; logs and returns (before, after, path)."""
    logs.setup_logging(None)
    scaled = scale_cfg(cfg)
    before, after = complexity(cfg), complexity(scaled)
    path = config.dump_cfg(scaled)
    for name, cx in (("before", before), ("after", after)):
        gflops, mparams = cx["flops"] / 1e9, cx["params"] / 1e6
        logger.info(f"{name} scaling: {gflops:.3f} GFLOPs, {mparams:.2f} M params")
        logs.log_json_stats({"_type": "complexity", "scaling": name, **cx})
    logger.info(f"scaled config ({cfg.MODEL.SCALING_TYPE} x {cfg.MODEL.SCALING_FACTOR}): {path}")
    return before, after, path
