"""Upstream pycls's convolutional families, their one home (``from pycls.models.cnn import
AnyNet``):

- ``cnn_layers``: what the families share: conv / BN / activation, SE, the head, the initialisation,
  ``ConvNet`` (stem, stages, head) and the ``Cx`` complexity counter;
- ``cnn_args``: what their arguments may be, plain Python (the config checks them too);
- ``anynet`` (stems, blocks, stages), ``regnet`` (quantized linear widths -> AnyNet), ``resnet``
  (ResNet / ResNeXt), ``effnet`` (EfficientNet), each with its analytic complexity;
- ``zoo_table``: upstream's published models, plain data; ``upstream_weights``: upstream's
  checkpoint files; ``model_scaling``: "Fast and Accurate Model Scaling"'s arithmetic.

The zoo's functions (``regnetx`` ... ``effnet``, ``build_model``) are ``pycls.models.zoo``'s,
which builds the ViT variants too.
"""

from typing import TYPE_CHECKING

from pycls.package_faces import install_face

# The face (pycls.package_faces): each name imports its module on first use, so that the config's
# torch-free reads of cnn_args and zoo_table cost no torch
if TYPE_CHECKING:
    from pycls.models.cnn.anynet import AnyNet, anynet_complexity
    from pycls.models.cnn.effnet import EffNet, effnet_complexity
    from pycls.models.cnn.regnet import RegNet, regnet_complexity
    from pycls.models.cnn.resnet import ResNet, resnet_complexity

install_face(__name__)
