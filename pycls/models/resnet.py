"""Re-export shim at upstream pycls's path: ``ResNet`` lives in ``pycls.models.cnn.resnet``, the
convolutional families' home; ``from pycls.models.resnet import ResNet`` keeps working as upstream's
users write it. The module's other names: ``pycls.models.cnn.resnet`` (docs/changing_pycls.md)."""

from pycls.models.cnn.resnet import ResNet, resnet_complexity

__all__ = ["ResNet", "resnet_complexity"]
