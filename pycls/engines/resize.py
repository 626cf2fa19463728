"""Applying an image-size change to a model in training (the image-size curriculum), without
losing optimizer state: the model's own ``set_image_size(size, optimizer, ema)`` carries its
optimizer state and EMA along (the ViT resamples its position embedding and every tensor of its
shape in place: ``pycls.models.vit.position``); a CNN only records the size.
"""


def set_image_size(module, size, optimizer=None, ema=None):
    """Switches the model (the plain module, not a parallel wrapper) to ``size`` px; carries
    optimizer state and EMA along. Returns whether anything changed."""
    if module.image_size == size:
        return False
    module.set_image_size(size, optimizer=optimizer, ema=ema)
    return True
