"""Fine-tuning a model before training: TRAIN.WEIGHTS loaded, TRAIN.FREEZE applied."""

import logging
import os

from pycls.checkpoint import sharded, single_file
from pycls.checkpoint.weight_files import load_weights
from pycls.core.builders import weights_file
from pycls.models.groups import freeze

logger = logging.getLogger(__name__)


def prepare_model(cfg, model) -> None:
    """TRAIN.WEIGHTS and TRAIN.FREEZE applied to the plain model, before any engine wraps it.

    The weights are skipped when the run will resume from its own checkpoint (which holds them,
    fine-tuned). Loading into the plain fp32 model works the same for every TRAIN.PARALLEL.
    """
    t = cfg.TRAIN
    resuming = t.AUTO_RESUME and single_file.get_last_checkpoint(cfg.OUT_DIR)
    # A model built on the meta device (FSDP2 and pipeline processes other than rank 0) gets
    # rank 0's weights, these included, from its engine
    on_meta = any(p.is_meta for p in model.parameters())
    if t.WEIGHTS and not resuming and not on_meta:
        path = weights_file(cfg, "TRAIN.WEIGHTS")  # a path, or zoo:NAME's published file
        if os.path.isdir(path):  # a sharded pycls checkpoint folder
            sharded.load_model_weights(path, model, cfg.ALLOW_UNVERIFIED_CHECKPOINTS)
        else:
            load_weights(path, model, t.WEIGHTS_FORMAT)
        logger.info(f"initialised weights from {t.WEIGHTS}")
    frozen = freeze(model, t.FREEZE, cfg.VIT.DEPTH)
    if frozen:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(
            f"TRAIN.FREEZE {t.FREEZE}: {len(frozen)} parameter tensors frozen, "
            f"{trainable} parameters trained"
        )
