"""Muon's update of one weight matrix ("Muon: an optimizer for hidden layers in neural networks",
Keller Jordan, 2024): the momentum of its gradient, orthogonalised by a Newton-Schulz iteration.

With momentum ``mu``: ``b = mu b + (1 - mu) g`` (torch.optim.Muon's ``lerp`` form), the direction
``d = g + mu (b - g)`` with Nesterov (else ``b``), ``o = NS(d)``, then ``w *= 1 - lr wd`` and
``w -= lr s o`` with ``s`` the shape's scale (``ADJUST_LR``). The arithmetic is torch.optim.Muon's
(bfloat16 iteration, the same coefficients, norm clamp and scales; tests/optim/test_muon.py checks
100 steps equal to it), written here so that the optimizer (``pycls.optim.optimizers.Muon``) can run
it on what torch.optim.Muon does not take: fp32 master copies (AMP O2), contiguous buffers and
FSDP2's sharded parameters.

The iteration needs the whole matrix, and FSDP2 gives each process a block of its rows. Each
process gathers the whole direction (in bfloat16, the iteration's own precision: the all-gather
moves half of fp32's bytes and changes nothing), orthogonalises it and keeps its rows: every
process computes every matrix's iteration, which costs compute, not communication (an all-gather
of the weights' size per step in bfloat16, half of what FSDP2's forward gathers).
"""

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pycls.optim.newton_schulz import NS_COEFFICIENTS, NS_EPS
from pycls.optim.optimizer_options import MUON_ADJUST_LRS

# How the orthogonalised update is scaled for the matrix's shape (out, in):
# "original" sqrt(max(1, out / in)) (Keller Jordan's, rates around 0.02); "match_rms_adamw"
# 0.2 sqrt(max(out, in)) (Moonlight: the update's RMS is AdamW's, so AdamW's rate and decay
# carry over). The names' one owner is the optimizer's settings record
ADJUST_LR = MUON_ADJUST_LRS


def orthogonalize(matrix, steps=5, coefficients=NS_COEFFICIENTS, eps=NS_EPS):
    """The Newton-Schulz approximation of ``U V^T`` for ``matrix = U S V^T`` (singular values
    land near 1, in about [0.5, 1.5]), in bfloat16 on the wide orientation of the matrix."""
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.bfloat16()
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def shape_scale(shape, rule):
    """The factor ``ADJUST_LR`` ``rule`` gives a matrix of ``shape`` (out, in)."""
    rows, cols = shape[:2]
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"MUON.ADJUST_LR {rule!r} is not one of {list(ADJUST_LR)}")


def _orthogonalize_whole(direction, steps, coefficients, eps):
    """``orthogonalize`` of the whole matrix ``direction`` (a tensor, or FSDP2's DTensor: then
    gathered in bfloat16, orthogonalised, and each process's part returned as a DTensor)."""
    if not isinstance(direction, DTensor):
        return orthogonalize(direction, steps, coefficients, eps)
    whole = direction.to(torch.bfloat16).full_tensor()
    ortho = orthogonalize(whole, steps, coefficients, eps)
    # Every process holds the whole result: each keeps its part, no communication
    return distribute_tensor(ortho, direction.device_mesh, direction.placements, src_data_rank=None)


@torch.no_grad()
def muon_update(weights, grads, momenta, group):
    """One Muon step of each matrix in ``weights`` (with its gradient and momentum buffer), in
    place, with the rates and settings of the parameter ``group``."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    steps, coefficients, eps = group["ns_steps"], group["ns_coefficients"], group["ns_eps"]
    for w, g, b in zip(weights, grads, momenta):
        b.lerp_(g, 1 - mu)
        direction = g.lerp(b, mu) if group["nesterov"] else b
        ortho = _orthogonalize_whole(direction, steps, coefficients, eps)
        w.mul_(1 - lr * wd)
        w.add_(ortho, alpha=-lr * shape_scale(w.shape, group["adjust_lr"]))
