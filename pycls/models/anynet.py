"""Re-export shim at upstream pycls's path: ``AnyNet`` lives in ``pycls.models.cnn.anynet``, the
convolutional families' home; ``from pycls.models.anynet import AnyNet`` keeps working as upstream's
users write it. The module's other names: ``pycls.models.cnn.anynet`` (docs/changing_pycls.md)."""

from pycls.models.cnn.anynet import AnyNet, anynet_complexity

__all__ = ["AnyNet", "anynet_complexity"]
