"""Re-export shim at upstream pycls's path: ``RegNet`` lives in ``pycls.models.cnn.regnet``, the
convolutional families' home; ``from pycls.models.regnet import RegNet`` keeps working as upstream's
users write it. The module's other names: ``pycls.models.cnn.regnet`` (docs/changing_pycls.md)."""

from pycls.models.cnn.regnet import RegNet, regnet_complexity, regnet_to_anynet

__all__ = ["RegNet", "regnet_complexity", "regnet_to_anynet"]
