"""Other libraries' optimizers on pycls's parameter groups (weight decay and no-decay, layer
decay, frozen parameters left out: ``optimizer_settings.param_groups``) and learning-rate
schedule (``schedules.set_lr`` sets every group's rate each step): timm's registry by name
(``timm:NAME``, built by ``timm.optim.create_optimizer_v2``) and Schedule-Free AdamW (the
``schedulefree`` package). Both packages are optional: each is imported where its optimizer is
built. What the config accepts is plain data in ``library_names``.

Schedule-Free AdamW keeps two points of the weights: y, where gradients are taken (the model's
parameters while training), and x, an average that is the model to evaluate and keep; its
``eval()`` and ``train()`` move the parameters between them. ``evaluation_weights(optimizer)``
is the one interface the rest of pycls uses: a context in which the model holds the weights to
evaluate, export, average (EMA) or save, for any optimizer (a no-op but for Schedule-Free).
Leaving it puts back y bitwise, so an evaluation or a checkpoint changes nothing of training; a
checkpoint written inside it holds x as the model and y in the optimizer state, and loading it
puts y back, so a resumed run continues bitwise (``ScheduleFreePoints``).
"""

import contextlib

import torch

from pycls.errors import ConfigError

__all__ = ["ScheduleFreePoints", "evaluation_weights", "schedule_free_adamw", "timm_optimizer"]

# What Schedule-Free AdamW keeps in each parameter group besides hyperparameters: its step
# count, the sum of its averaging weights, the largest rate seen, the last rate and which point
# the parameters hold. A resume restores them from the checkpoint, where hyperparameters come
# from the current config (``pycls.core.resume_point.apply_hyperparameters``)
SCHEDULE_FREE_GROUP_STATE = ("k", "weight_sum", "lr_max", "scheduled_lr", "train_mode")


def timm_optimizer(groups, name, *, lr, weight_decay, momentum, betas, eps):
    """timm's optimizer ``name`` over ``groups``. ``momentum``, ``betas`` and ``eps`` reach the
    optimizers that take them (timm drops the others); an optimizer with another number of betas
    than two (Adan's three) keeps its own."""
    try:
        # optional: only the timm: optimizers need timm
        from timm.optim import create_optimizer_v2, get_optimizer_info
    except ImportError:
        raise ConfigError(
            f"OPTIM.OPTIMIZER: timm:{name} needs the timm package (pip install timm, or "
            "pycls-vit[timm])"
        ) from None
    try:
        info = get_optimizer_info(name)
    except ValueError:  # a timm older than the list of names pycls checks against
        raise ConfigError(
            f"OPTIM.OPTIMIZER: timm:{name} is not in the installed timm's registry; upgrade timm"
        ) from None
    kwargs = dict(momentum=momentum, eps=eps)
    if info.num_betas == len(betas):
        kwargs["betas"] = tuple(betas)
    return create_optimizer_v2(groups, opt=name, lr=lr, weight_decay=weight_decay, **kwargs)


def schedule_free_adamw(groups, *, lr, betas, eps, weight_decay):
    """Schedule-Free AdamW over ``groups``, in training mode, with ``ScheduleFreePoints``
    attached (its own warm-up is off: the schedule's warm-up sets the groups' rates)."""
    try:
        import schedulefree  # optional: only OPTIM.OPTIMIZER schedulefree_adamw needs it
    except ImportError:
        raise ConfigError(
            "OPTIM.OPTIMIZER: schedulefree_adamw needs the schedulefree package (pip install "
            "schedulefree, or pycls-vit[schedulefree])"
        ) from None
    optimizer = schedulefree.AdamWScheduleFree(
        groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, warmup_steps=0
    )
    optimizer.train()
    optimizer.weight_modes = ScheduleFreePoints(optimizer)
    optimizer.running_group_keys = SCHEDULE_FREE_GROUP_STATE
    return optimizer


def evaluation_weights(optimizer):
    """A context in which the model holds the weights to evaluate and keep: Schedule-Free's
    average x; any other optimizer's parameters as they are."""
    modes = getattr(optimizer, "weight_modes", None)
    return modes.evaluation() if modes is not None else contextlib.nullcontext()


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


class ScheduleFreePoints:
    """Schedule-Free's two points for the rest of pycls: ``evaluation()``, and the state-dict
    hooks that keep y in checkpoints (state key "y", beside z and the second moment)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.training_points = None  # {parameter: y} while the parameters hold x
        optimizer.register_state_dict_post_hook(self._with_training_points)
        optimizer.register_load_state_dict_post_hook(self._back_to_training_points)

    def training(self):
        return all(group["train_mode"] for group in self.optimizer.param_groups)

    @contextlib.contextmanager
    @torch.no_grad()
    def evaluation(self):
        """x in the parameters within the block; y, bitwise, after it (nested blocks: one
        switch)."""
        if not self.training():
            yield
            return
        self.training_points = {p: p.detach().clone() for p in _params(self.optimizer)}
        self.optimizer.eval()
        try:
            yield
        finally:
            for p, y in self.training_points.items():
                p.copy_(y)
            self.training_points = None
            for group in self.optimizer.param_groups:
                group["train_mode"] = True

    def _training_point(self, p):
        if self.training_points is not None:
            return self.training_points[p]
        return p.detach().clone()  # a copy: DCP loads a checkpoint into these tensors in place

    def _with_training_points(self, optimizer, state_dict):
        """y beside each parameter's state, numbered as the state dict numbers parameters."""
        states = state_dict["state"]
        for i, p in enumerate(_params(optimizer)):
            if i in states:
                states[i] = {**states[i], "y": self._training_point(p)}
        return state_dict

    @torch.no_grad()
    def _back_to_training_points(self, optimizer):
        """After a load: y back into the parameters (the model loaded x); a state without y
        (written elsewhere) goes back to training by Schedule-Free's own interpolation."""
        restored = False
        for p in _params(optimizer):
            y = optimizer.state.get(p, {}).pop("y", None)
            if y is not None:
                p.copy_(y)
                restored = True
        if restored:
            for group in optimizer.param_groups:
                group["train_mode"] = True
        else:
            optimizer.train()
