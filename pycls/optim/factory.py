"""The optimizer a plain description asks for: ``OptimizerSettings`` (what the builders fill
from the config's OPTIM and MUON keys) and ``optimizer_from_settings``, which builds it over the
weight-decay (and layer-decay) groups of a model."""

from dataclasses import dataclass

from pycls.optim.one_pass import OnePassAdamW
from pycls.optim.optimizers import LAMB, SGD, AdamW, Muon, param_groups

__all__ = ["OPTIMIZERS", "OptimizerSettings", "optimizer_from_settings"]


@dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer is made of, as plain values (``pycls.core.builders`` fills it from the
    config's OPTIM and MUON keys)."""

    name: str = "adamw"  # "sgd", "adamw", "lamb" or "muon"
    lr: float = 1e-3
    weight_decay: float = 0.05
    no_decay_weight_decay: float = 0.0  # norms, biases, embeddings, class token
    layer_decay: float = 1.0  # < 1: per-layer learning-rate scales over ``depth`` blocks
    depth: int = 0
    momentum: float = 0.9  # SGD
    dampening: float = 0.0
    nesterov: bool = True
    betas: tuple = (0.9, 0.999)  # AdamW, LAMB, and Muon's AdamW groups
    eps: float = 1e-8
    contiguous: bool = False
    one_pass: bool = False  # AdamW as one compiled pass over the flat buffers (OnePassAdamW)
    muon_lr_mult: float = 1.0  # Muon: its matrices' rate as a multiple of the scheduled one
    muon_weight_decay: float = 0.05
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"


OPTIMIZERS = ("sgd", "adamw", "lamb", "muon")


def optimizer_from_settings(model, settings, master_weights=False):
    """The optimizer ``settings`` describe, over weight-decay groups built from the model.

    Build it after the model is on its device and cast for the AMP level: the contiguous mode
    rebinds the parameters onto its buffers, and master weights copy them.
    """
    s = settings
    if s.name not in OPTIMIZERS:
        raise ValueError(f"optimizer {s.name!r} is not one of {list(OPTIMIZERS)}")
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
