"""The training losses MODEL.LOSS_FUN names: softmax cross-entropy (torch's, with label
smoothing) and binary cross-entropy per class, as DeiT III trains ("DeiT III: Revenge of the ViT",
Touvron et al., 2022; facebookresearch/deit, main.py ``--bce-loss`` and engine.py's
``targets.gt(0.0)``) and as timm's ``BinaryCrossEntropy`` computes it. Both take class indices or
the soft targets mixup and cutmix give; the meters see the logits and the hard labels either way.
"""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BinaryCrossEntropy"]


class BinaryCrossEntropy(nn.Module):
    """One sigmoid per class: the mean over batch x classes of the binary cross-entropy of
    ``logits`` against ``targets`` (class indices, made one-hot, or soft targets of the logits'
    shape).

    ``smoothing`` moves every target t to t (1 - s) + s / classes, as label smoothing moves a
    one-hot target (timm's BinaryCrossEntropy on indices, timm's Mixup on mixed targets). With
    ``target_threshold`` (not None) the targets then become 1 above it and 0 elsewhere: DeiT III
    binarises mixup's targets with 0, so both classes of a mixed image are fully present.
    """

    def __init__(self, smoothing=0.0, target_threshold=None):
        super().__init__()
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing, self.target_threshold = smoothing, target_threshold

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        classes = logits.shape[-1]
        if targets.shape != logits.shape:
            targets = F.one_hot(targets.long(), classes)
        targets = targets.to(logits.dtype)
        if self.smoothing:
            targets = targets * (1.0 - self.smoothing) + self.smoothing / classes
        if self.target_threshold is not None:
            targets = targets.gt(self.target_threshold).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, targets)

    def extra_repr(self) -> str:
        return f"smoothing={self.smoothing}, target_threshold={self.target_threshold}"
