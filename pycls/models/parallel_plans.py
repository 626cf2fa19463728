"""What the engines ask of a model they cut over processes: ``parallel_plan(model, engine)``
gives its plan (pipeline chunks, tensor- and sequence-parallel layers, the row order of its
checkpoints), which lives beside the model it cuts (the ViT's: ``pycls.models.vit.parallel_plan``).
The engines call only this interface and name no model."""

from pycls.models.vit.parallel_plan import VitParallelPlan
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
