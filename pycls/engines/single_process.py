"""TRAIN.PARALLEL none: the model in this process alone, cast for the AMP level."""

from pycls.engines.base import Engine


class SingleProcess(Engine):
    name = "none"

    def __init__(self, model, settings, device, precision):
        super().__init__(precision.prepare_model(model), settings, device, precision)
