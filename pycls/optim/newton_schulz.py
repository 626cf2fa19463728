"""Muon's Newton-Schulz iteration as numbers, torch-free: its coefficients and how many steps can
change anything (the config bounds MUON.NS_STEPS by it when it is read, without torch;
``pycls.optim.muon`` runs the iteration)."""

import math

# Keller Jordan's quintic coefficients and epsilon, as torch.optim.Muon has them
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7

# bfloat16's smallest normal number (torch.finfo(torch.bfloat16).tiny): the iteration's precision
BFLOAT16_TINY = 2.0**-126


def max_ns_steps():
    """Newton-Schulz steps after which every singular value the iteration can hold has reached
    its band: it runs in bfloat16 on a matrix scaled to a norm of at most 1, and each step
    multiplies a small singular value by the first coefficient (3.4445), so one as small as
    bfloat16's smallest normal number (2^-126) gets there in log(2^126) / log(3.4445) = 71
    steps. Each step after that costs three matrix products per matrix and changes nothing."""
    return math.ceil(-math.log(BFLOAT16_TINY) / math.log(NS_COEFFICIENTS[0]))
