"""Precise batch-norm statistics (BN.USE_PRECISE_STATS), recomputed before each evaluation.

The running averages a batch-norm layer keeps while training trail the weights, which keep
moving; upstream pycls ("Designing Network Design Spaces", after Wu and Johnson, "Rethinking
'batch' in batchnorm") replaces them before evaluating by the mean, over a fixed number of
training images, of each batch's mean and (unbiased) variance, with the current weights.

Across processes the result is the same as in one process over all their batches: each process
averages its own batches (every process runs the same number of equal batches), then the
processes average those means.
"""

import itertools

import torch
from torch import nn

from pycls import distributed as dist

_BN = nn.modules.batchnorm._BatchNorm


def num_precise_batches(num_samples, batch_size, num_batches, world_size):
    """Batches each process runs: ``num_samples`` images over all processes, at most one pass."""
    return min(num_batches, max(1, num_samples // (batch_size * world_size)))


@torch.no_grad()
def recompute_bn_stats(module, batches, num_batches, forward=None):
    """Replaces the running mean and variance of every batch norm in ``module`` by their average
    over the first ``num_batches`` of ``batches`` (image tensors, or tuples starting with one)
    and over the processes. ``forward`` runs the module on a batch (default: ``module(images)``;
    the trainer passes one that casts the input under AMP). Returns the batches used here."""
    bns = [m for m in module.modules() if isinstance(m, _BN) and m.track_running_stats]
    if not bns or num_batches <= 0:
        return 0
    forward = forward or module
    means = [torch.zeros_like(bn.running_mean) for bn in bns]
    variances = [torch.zeros_like(bn.running_var) for bn in bns]
    momenta = [bn.momentum for bn in bns]
    training = module.training
    module.train()
    for bn in bns:
        bn.momentum = 1.0  # running stats = this batch's statistics
    used = 0
    try:
        for batch in itertools.islice(batches, num_batches):
            images = batch[0] if isinstance(batch, tuple | list) else batch
            forward(images)
            for i, bn in enumerate(bns):
                means[i] += bn.running_mean
                variances[i] += bn.running_var
            used += 1
    finally:
        for bn, momentum in zip(bns, momenta):
            bn.momentum = momentum
        module.train(training)
    total = torch.tensor([float(used)], device=means[0].device)
    dist.all_reduce_sum([*means, *variances, total])
    for bn, mean, var in zip(bns, means, variances):
        bn.running_mean.copy_(mean / total)
        bn.running_var.copy_(var / total)
    return used
