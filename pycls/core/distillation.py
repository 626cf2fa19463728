"""Knowledge distillation as DeiT trains ("Training data-efficient image transformers &
distillation through attention", Touvron et al., 2021): a fixed teacher predicts every training
batch, and the student learns from its predictions beside the labels.

``Teacher`` runs the teacher network: in eval mode, without gradients, under the run's AMP level
(cast as the student is, under the same autocast), giving fp32 logits. It is not part of the
engine: it is not sharded, saved, averaged (EMA) or compiled with the student. Under DDP and
FSDP2 every process holds the whole teacher on its device: it is read-only and sees only the
process's own share of the batch, so a replica costs its weights' memory once (RegNetY-16GF,
83.6 M parameters: 0.33 GB in fp32) and no communication, where sharding it would all-gather
every layer of it at every step for a memory saving the student's optimizer state dwarfs.

``DistillationLoss`` is DeiT's ``DistillationLoss`` on fixed logits: the base loss of the class
head, and the distillation term of the distillation head (both from the student's output pair;
a student with one head gives one tensor, which takes both terms).
"""

import torch
import torch.nn.functional as F

KINDS = ("hard", "soft")


class DistillationLoss:
    """``(1 - alpha) * base(class logits, targets) + alpha * term(distillation logits, teacher
    logits)``, with ``term`` for ``kind``:

    - "hard": cross-entropy with the teacher's top class;
    - "soft": ``KL(softmax(t / tau) || softmax(s / tau)) * tau^2``, summed and divided by the
      number of logits (batch x classes), as DeiT divides (its ``outputs_kd.numel()``).

    ``base`` is the run's loss (cross-entropy with label smoothing, soft targets under mixup).
    Called as ``loss(outputs, teacher_logits, targets)``; ``bind(teacher_logits)`` gives the
    ``loss(outputs, targets)`` an engine calls. Without teacher logits (a micro-batch with no
    image, whose pass only keeps the processes in step) the distillation head is supervised by
    the targets, so every parameter takes part in the backward pass.
    """

    def __init__(self, base, kind="hard", alpha=0.5, tau=1.0):
        if kind not in KINDS:
            raise ValueError(f"distillation kind {kind!r} is not one of {list(KINDS)}")
        if not 0.0 <= alpha <= 1.0 or tau <= 0:
            raise ValueError(f"distillation: alpha {alpha} must be in [0, 1], tau {tau} > 0")
        self.base, self.kind, self.alpha, self.tau = base, kind, alpha, tau

    def __call__(self, outputs, teacher_logits, targets):
        logits, dist_logits = outputs if isinstance(outputs, tuple) else (outputs, outputs)
        base = self.base(logits, targets)
        if teacher_logits is None:
            term = self.base(dist_logits, targets)
        elif self.kind == "hard":
            term = F.cross_entropy(dist_logits, teacher_logits.argmax(dim=1))
        else:
            t = self.tau
            term = (
                F.kl_div(
                    F.log_softmax(dist_logits / t, dim=1),
                    F.log_softmax(teacher_logits / t, dim=1),
                    reduction="sum",
                    log_target=True,
                )
                * (t * t)
                / dist_logits.numel()
            )
        return base * (1 - self.alpha) + term * self.alpha

    def bind(self, teacher_logits):
        """The loss of one micro-batch as an engine calls it: ``loss(outputs, targets)``."""
        return lambda outputs, targets: self(outputs, teacher_logits, targets)


class Teacher:
    """A trained network's predictions, fixed: ``teacher(images)`` gives fp32 logits.

    ``module`` is put on ``device`` and cast as ``precision`` (a ``pycls.engines.Precision``)
    casts the student, in eval mode with its parameters frozen; each call runs under the same
    autocast, without gradients. ``compile``: torch.compile it (one inference graph).
    ``identity``: what the run records of the teacher in its checkpoints (its source and the
    SHA-256 of its weights), so that a resume can tell it is the same teacher.
    """

    def __init__(self, module, device, precision, compile=False, identity=None):
        module = precision.prepare_model(module.to(device)).eval().requires_grad_(False)
        self.module, self.precision, self.identity = module, precision, identity
        self.forward = torch.compile(module) if compile else module

    @torch.no_grad()
    def __call__(self, images):
        p = self.precision
        with p.autocast():
            logits = self.forward(p.cast_input(images))
        return logits.float()

    @property
    def num_classes(self):
        return self.module.num_classes
