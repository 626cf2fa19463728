"""The parameter groups an optimizer trains, built from the model (weight decay, layer decay,
Muon's matrices), and the optimizer an ``OptimizerSettings`` (``pycls.optim.optimizer_options``:
what an optimizer is asked to do, as plain values the builders fill from the config) describes
(``pycls.optim.optimizers``, ``pycls.optim.one_pass``, or another library's:
``pycls.optim.library_optimizers``) they build (``optimizer_from_settings``).
"""

from pycls.models.groups import hidden_matrix_names, no_weight_decay_names
from pycls.models.layer_ids import layer_id, lr_scale
from pycls.optim import library_optimizers
from pycls.optim.library_names import OWN, SCHEDULE_FREE, TIMM_OPTIMIZERS, timm_name
from pycls.optim.one_pass import OnePassAdamW
from pycls.optim.optimizer_options import WEIGHT_DECAY_SCALES, OptimizerSettings
from pycls.optim.optimizers import LAMB, SGD, AdamW, Muon

__all__ = ["OptimizerSettings", "no_weight_decay_names", "optimizer_from_settings", "param_groups"]


def param_groups(
    model,
    weight_decay,
    no_decay_weight_decay=0.0,
    *,
    layer_decay=1.0,
    depth=0,
    muon_weight_decay=None,
    muon_lr_mult=1.0,
):
    """Parameter groups by weight decay and, with ``layer_decay`` < 1, by layer.

    Without layer decay: two groups, weights with ``weight_decay`` ("decay") and norms, biases,
    embeddings with the other rate ("no_decay"). With it, each of those is split by layer
    (``pycls.models.groups.layer_id`` over ``depth`` blocks) into groups "layer{l}_decay" and
    "layer{l}_no_decay" carrying ``lr_scale = layer_decay ** (depth + 1 - l)``, which
    ``schedules.set_lr`` applies. Parameters that require no gradient (frozen) are left out.

    With ``muon_weight_decay`` (not None), the hidden matrices (``hidden_matrix_names``) leave
    "decay" for groups of their own ("muon", per layer "layer{l}_muon") marked ``use_muon``, with
    that decay and ``lr_scale`` times ``muon_lr_mult``.
    """

    skip = no_weight_decay_names(model)
    hidden = hidden_matrix_names(model) if muon_weight_decay is not None else set()
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = "no_decay" if name in skip else "muon" if name in hidden else "decay"
        layer = layer_id(name, depth) if layer_decay != 1.0 else None
        if (layer, kind) not in groups:
            wd = {"no_decay": no_decay_weight_decay, "muon": muon_weight_decay}.get(kind)
            group = {"params": [], "weight_decay": weight_decay if wd is None else wd}
            group["name"] = kind if layer is None else f"layer{layer}_{kind}"
            scale = lr_scale(layer, depth, layer_decay) if layer is not None else None
            if kind == "muon":
                group.update(use_muon=True, lr_scale=(scale or 1.0) * muon_lr_mult)
            elif scale is not None:
                group["lr_scale"] = scale
            groups[(layer, kind)] = group
        groups[(layer, kind)]["params"].append(p)
    # A fixed order (by layer, decay before no-decay before Muon) so optimizer state dicts line up
    order = {"decay": 0, "no_decay": 1, "muon": 2}
    keys = sorted(groups, key=lambda k: (-1 if k[0] is None else k[0], order[k[1]]))
    return [groups[k] for k in keys]


OPTIMIZERS = OWN


def optimizer_from_settings(model, settings, master_weights=False):
    """The optimizer ``settings`` describe, over weight-decay groups built from the model.

    Build it after the model is on its device and cast for the AMP level: the contiguous mode
    rebinds the parameters onto its buffers, and master weights copy them. Other libraries'
    optimizers (``library_optimizers``) keep no master weights: they refuse ``master_weights``.
    """
    s = settings
    groups = param_groups(
        model,
        s.weight_decay,
        s.no_decay_weight_decay,
        layer_decay=s.layer_decay,
        depth=s.depth,
        muon_weight_decay=s.muon_weight_decay if s.name == "muon" else None,
        muon_lr_mult=s.muon_lr_mult,
    )
    for group in groups:  # the schedule sets the rates every iteration; start at the base rate
        group["lr"] = s.lr * group.get("lr_scale", 1.0)
    _scale_weight_decay(groups, s)
    if s.name in OWN:
        return _own_optimizer(groups, s, master_weights)
    if master_weights or s.contiguous:
        raise ValueError(f"optimizer {s.name!r} keeps no master weights or contiguous buffers")
    adam = dict(lr=s.lr, betas=tuple(s.betas), eps=s.eps, weight_decay=s.weight_decay)
    if s.name == SCHEDULE_FREE:
        return library_optimizers.schedule_free_adamw(groups, **adam)
    if timm_name(s.name) in TIMM_OPTIMIZERS:
        name = timm_name(s.name)
        return library_optimizers.timm_optimizer(groups, name, momentum=s.momentum, **adam)
    raise ValueError(f"optimizer {s.name!r} is not one of {list(OWN)}, {SCHEDULE_FREE}, timm:NAME")


def _scale_weight_decay(groups, s):
    """Under ``weight_decay_scale`` "schedule", each group's decay divided by its base rate: the
    optimizer multiplies it by the group's scheduled rate, which leaves the schedule's factor."""
    if s.weight_decay_scale not in WEIGHT_DECAY_SCALES:
        scales = list(WEIGHT_DECAY_SCALES)
        raise ValueError(f"weight_decay_scale {s.weight_decay_scale!r} is not one of {scales}")
    if s.weight_decay_scale == "lr":
        return
    for group in groups:
        if group["weight_decay"]:
            if group["lr"] <= 0:
                raise ValueError("weight_decay_scale 'schedule' needs a base rate above 0")
            group["weight_decay"] = group["weight_decay"] / group["lr"]


def _own_optimizer(groups, s, master_weights):
    """One of pycls's fused optimizers (``pycls.optim.optimizers``, ``one_pass``)."""
    common = dict(contiguous=s.contiguous, master_weights=master_weights)
    if s.name == "sgd":
        return SGD(
            groups,
            lr=s.lr,
            momentum=s.momentum,
            dampening=s.dampening,
            nesterov=s.nesterov,
            weight_decay=s.weight_decay,
            **common,
        )
    adam = dict(lr=s.lr, betas=tuple(s.betas), eps=s.eps, weight_decay=s.weight_decay)
    if s.name == "muon":
        if not any(g.get("use_muon") for g in groups):
            raise ValueError(
                "optimizer 'muon': the model has no hidden 2-D weights (the matrices of a ViT's "
                "blocks) to orthogonalise"
            )
        muon_args = dict(momentum=s.muon_momentum, nesterov=s.muon_nesterov)
        muon_args.update(ns_steps=s.muon_ns_steps, adjust_lr=s.muon_adjust_lr)
        return Muon(groups, **muon_args, **adam, **common)
    if s.one_pass:
        if s.name != "adamw" or not s.contiguous:
            raise ValueError("one_pass is AdamW's over contiguous buffers: name adamw, contiguous")
        return OnePassAdamW(groups, **adam, master_weights=master_weights)
    kind = AdamW if s.name == "adamw" else LAMB
    return kind(groups, **adam, **common)
