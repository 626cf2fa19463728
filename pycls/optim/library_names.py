"""The names OPTIM.OPTIMIZER takes beside pycls's own optimizers, as plain data that the config
checks without importing torch, timm or schedulefree: Schedule-Free AdamW (the ``schedulefree``
package) and timm's optimizer registry as ``timm:NAME``, with the names left out and why, and the
ones FSDP2's sharded parameters cannot run. The optimizers themselves are built by
``pycls.optim.library_optimizers``.
"""

import difflib

__all__ = [
    "OWN",
    "SCHEDULE_FREE",
    "TIMM_LEFT_OUT",
    "TIMM_NOT_UNDER_FSDP",
    "TIMM_OPTIMIZERS",
    "TIMM_PREFIX",
    "closest_names",
    "is_library_optimizer",
    "timm_name",
]

# pycls's own fused optimizers (pycls.optim.optimizers): the defaults and the fast path
OWN = ("sgd", "adamw", "lamb", "muon")

# Schedule-Free AdamW (Defazio et al., 2024, "The Road Less Scheduled"), from the schedulefree
# package: no decaying schedule (OPTIM.LR_POLICY constant, after a warm-up)
SCHEDULE_FREE = "schedulefree_adamw"

TIMM_PREFIX = "timm:"

# timm's registry (timm.optim.list_optimizers(), timm 1.0.31) less TIMM_LEFT_OUT, each name as
# timm spells it; tests/optim/test_library_optimizers.py holds it to the installed timm's registry
TIMM_OPTIMIZERS = (
    "adabelief", "adadelta", "adafactor", "adafactorbv", "adafactorbvc", "adagrad", "adam",
    "adamax", "adamc", "adamp", "adamuon", "adamw", "adamwlegacy", "adan", "adanw", "adopt",
    "adoptc", "adoptw", "cadafactor", "cadafactorbv", "cadafactorbvc", "cadamc", "cadamp",
    "cadamw", "cadan", "cadanw", "cadopt", "cadoptc", "cadoptw", "clamb", "clambw", "claprop",
    "clion", "clionc", "cmars", "cnadamc", "cnadamw", "crmsproptf", "csgdc", "csgdp", "csgdw",
    "kron", "kronc", "kronw", "lamb", "lambc", "lambcd", "lambcw", "lambw", "laprop", "lapropc",
    "larc", "lars", "lion", "lionc", "madgrad", "madgradw", "mars", "momentum", "muon", "nadam",
    "nadamc", "nadamlegacy", "nadamuon", "nadamw", "nesterov", "nesterovw", "nlarc", "nlars",
    "nmuon", "novograd", "novogradc", "novogradw", "radabelief", "radam", "radamlegacy",
    "radamw", "rmsprop", "rmsproptf", "rmsproptfc", "rmsproptfw", "sgd", "sgdc", "sgdp", "sgdw",
)  # fmt: skip

_APEX = "NVIDIA apex's CUDA kernels, a package pycls does not install; use timm:{base} instead"
_BNB = "bitsandbytes' CUDA kernels, a package pycls does not install; use timm:{base} instead"

# Names of timm's registry that OPTIM.OPTIMIZER does not take, and why
TIMM_LEFT_OUT = {
    "fusedadam": _APEX.format(base="adam"),
    "fusedadamw": _APEX.format(base="adamw"),
    "fusedlamb": _APEX.format(base="lamb") + " (or pycls's own lamb)",
    "fusednovograd": _APEX.format(base="novograd"),
    "fusedsgd": _APEX.format(base="sgd") + " (or pycls's own sgd)",
    "bnbadam": _BNB.format(base="adam"),
    "bnbadam8bit": _BNB.format(base="adam"),
    "bnbadamw": _BNB.format(base="adamw"),
    "bnbadamw8bit": _BNB.format(base="adamw"),
    "bnbademamix": _BNB.format(base="adamw"),
    "bnbademamix8bit": _BNB.format(base="adamw"),
    "bnblion": _BNB.format(base="lion"),
    "bnblion8bit": _BNB.format(base="lion"),
    "bnbsgd": _BNB.format(base="sgd"),
    "bnbsgd8bit": _BNB.format(base="sgd"),
    "adahessian": (
        "a second-order method: it needs the gradients' own graph (backward with "
        "create_graph=True), which the training step does not keep"
    ),
}

_IN_PLACE = "an in-place update of a shard (DTensor) by {what}, which DTensor cannot run in place"
_CAUTIOUS = _IN_PLACE.format(what="the cautious mask's mean, a sum over every shard")
_NORM = _IN_PLACE.format(what="a norm that is a sum over every shard")
_EMPTY_SHARD = (
    "its step fails on a process whose shard of a parameter is empty (a class token: max() of "
    "no elements) while its peers wait in a collective"
)
_FACTORED = _IN_PLACE.format(what="its factored second moment (a local tensor)")
_SHARDED_MATRIX = (
    "it orthogonalises each process's shard of a matrix instead of the matrix: after two steps "
    "a third of the weights differ from one process's by more than 1e-4"
)

# The timm optimizers FSDP2's parameters (DTensor shards) break: name -> how. Measured by
# tests/engines/test_engines.py, which steps every name of TIMM_OPTIMIZERS twice on a 2-process
# FSDP2 model (timm 1.0.31, torch 2.14): these fail, or end elsewhere than one process's run.
# TRAIN.PARALLEL fsdp refuses them at load
TIMM_NOT_UNDER_FSDP = {
    **dict.fromkeys(("adafactor", "adafactorbv", "adafactorbvc"), _FACTORED),
    **dict.fromkeys(("adamp", "sgdp"), _EMPTY_SHARD),
    **dict.fromkeys(("adamuon", "nadamuon", "mars", "cmars"), _NORM),
    **dict.fromkeys(("kron", "kronc", "kronw"), "its compiled preconditioner cannot trace shards"),
    **dict.fromkeys(("novograd", "novogradc", "novogradw"), _NORM),
    **dict.fromkeys(("muon", "nmuon"), _SHARDED_MATRIX),
    **dict.fromkeys(
        ("cadafactor", "cadafactorbv", "cadafactorbvc", "cadamc", "cadamp", "cadamw", "cadan",
         "cadanw", "cadopt", "cadoptc", "cadoptw", "clamb", "clambw", "claprop", "clion",
         "clionc", "cnadamc", "cnadamw", "crmsproptf", "csgdc", "csgdp", "csgdw"),
        _CAUTIOUS,
    ),
}  # fmt: skip


def timm_name(value):
    """The timm registry name in an OPTIM.OPTIMIZER value ``timm:NAME``, else None."""
    return value[len(TIMM_PREFIX) :] if value.startswith(TIMM_PREFIX) else None


def is_library_optimizer(value):
    """Whether OPTIM.OPTIMIZER ``value`` is another library's optimizer (timm's, Schedule-Free's)
    rather than one of pycls's fused ones."""
    return value == SCHEDULE_FREE or timm_name(value) is not None


def known_names():
    """Every value OPTIM.OPTIMIZER takes."""
    return [*OWN, SCHEDULE_FREE, *(TIMM_PREFIX + n for n in TIMM_OPTIMIZERS)]


def closest_names(value, count=4):
    """The known OPTIM.OPTIMIZER values closest to ``value``, compared without timm's prefix (so
    "lion" finds "timm:lion", and "timm:adamw_" finds "adamw" and "timm:adamw")."""
    bare = timm_name(value) or value
    full = {}
    for name in known_names():
        full.setdefault(timm_name(name) or name, []).append(name)
    close = difflib.get_close_matches(bare, list(full), n=count, cutoff=0.6)
    return [name for c in close for name in full[c]][:count]
