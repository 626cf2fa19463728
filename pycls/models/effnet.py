"""Re-export shim at upstream pycls's path: ``EffNet`` lives in ``pycls.models.cnn.effnet``, the
convolutional families' home; ``from pycls.models.effnet import EffNet`` keeps working as upstream's
users write it. The module's other names: ``pycls.models.cnn.effnet`` (docs/changing_pycls.md)."""

from pycls.models.cnn.effnet import EffNet, effnet_complexity

__all__ = ["EffNet", "effnet_complexity"]
