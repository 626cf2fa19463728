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

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "anynet": ["AnyNet", "anynet_complexity"],
        "effnet": ["EffNet", "effnet_complexity"],
        "regnet": ["RegNet", "regnet_complexity"],
        "resnet": ["ResNet", "resnet_complexity"],
    },
)
