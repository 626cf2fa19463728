"""Checkpoint files written by upstream pycls (facebookresearch/pycls): the files its model zoo
publishes and its trainer writes.

Such a file is a torch file of ``{"model_state", "ema_state", "optimizer_state", "test_err",
"ema_err", "cfg", "epoch"}`` (older files lack the EMA and error entries) and, unlike ours, no
checksum. Only the weights are taken, and of the two sets the better one, as upstream's own
loader does: the model's unless the EMA's test error is lower. Files are read with
``weights_only=True`` like every checkpoint here.

This reader lives beside the models because the model zoo (``pycls.models.zoo``) loads the
published files with it; the checkpoint and weights code above reuses it.
"""

import logging
import os

import torch

logger = logging.getLogger(__name__)

# The checksum entry our own checkpoints carry (pycls.core.checkpoint) and upstream's lack
_OUR_CHECKSUM = "crc32"


class UpstreamCheckpointError(ValueError):
    """An upstream checkpoint file cannot be read; the message names the file."""


def is_upstream_checkpoint(obj) -> bool:
    """Whether a loaded torch object is an upstream pycls checkpoint."""
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("model_state"), dict)
        and _OUR_CHECKSUM not in obj
        and "epoch" in obj
    )


def best_weights(obj: dict, path: str = "") -> dict[str, torch.Tensor]:
    """The better of the checkpoint's model and EMA weights (upstream's rule: the model's when
    ``test_err <= ema_err``; a missing error counts as 100 %, a missing EMA as the model)."""
    test_err = obj.get("test_err", 100)
    ema_err = obj.get("ema_err", 100)
    use_ema = "ema_state" in obj and ema_err < test_err
    which = "ema_state" if use_ema else "model_state"
    logger.info(
        f"{path}: upstream pycls checkpoint (epoch {obj.get('epoch')}, test_err {test_err}, "
        f"ema_err {ema_err}): loading its {which}"
    )
    return obj[which]


def read_upstream_checkpoint(path: str) -> dict:
    """The whole checkpoint dict of an upstream file; UpstreamCheckpointError if it is not one."""
    if not os.path.isfile(path):  # a FIFO would block the read forever
        raise UpstreamCheckpointError(f"{path} is missing or no regular file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UpstreamCheckpointError(f"cannot read {path} as a torch file: {e}") from e
    if not is_upstream_checkpoint(obj):
        raise UpstreamCheckpointError(
            f"{path} is not an upstream pycls checkpoint (no 'model_state' and 'epoch', or it "
            "carries this fork's checksum)"
        )
    return obj


def is_upstream_checkpoint_file(path: str) -> bool:
    try:
        read_upstream_checkpoint(path)
    except UpstreamCheckpointError:
        return False
    return True
