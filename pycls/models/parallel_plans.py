"""What the engines ask of a model they cut over processes: ``parallel_plan(model, engine)``
gives its plan (pipeline chunks, tensor- and sequence-parallel layers, the row order of its
checkpoints), which lives beside the model it cuts (the ViT's: ``pycls.models.vit.parallel_plan``);
``tokens_per_image(model)`` the rows each of its linear layers sees per image (float8's choice of
layers). The engines call only this interface and name no model."""

import torch

from pycls.models.vit.parallel_plan import VitParallelPlan
from pycls.models.vit.token_masks import computed_tokens
from pycls.models.vit.transformer import VisionTransformer

# Model class -> its plan
PLANS = {VisionTransformer: VitParallelPlan}


def parallel_plan(model, engine):
    """The plan of ``model``'s family; ValueError naming the engine for a model without one."""
    for cls, plan in PLANS.items():
        if isinstance(model, cls):
            return plan(model)
    have = ", ".join(cls.__name__ for cls in PLANS)
    raise ValueError(
        f"TRAIN.PARALLEL {engine}: {type(model).__name__} has no plan to cut it over processes "
        f"(these models have one: {have})"
    )


def tokens_per_image(model):
    """The tokens a training image gives ``model``'s blocks at its image size (patch dropout
    applied), 0 for a model without tokens: each linear layer's rows per image."""
    size = getattr(model, "image_size", 0)
    images = torch.empty((1, 3, size, size), device="meta")
    return computed_tokens(model, images) if size else 0
