"""Applying an image-size change to a model in training, without losing optimizer state.

The position embedding is resampled in place (the same ``nn.Parameter``), and so is every
optimizer state tensor of its shape (Adam's moments, momentum, O2 master weights) and its EMA
copy. Optimizers keep referring to the parameter they were built with: replacing the Parameter
instead would leave the optimizer updating a stale tensor that the model no longer uses.
"""

import torch

from pycls.models.vit import resample_pos_embed

# Optimizer state that must stay non-negative after resampling (bicubic overshoot)
_NON_NEGATIVE_STATE = ("exp_avg_sq", "max_exp_avg_sq")


def _resample_like(tensor, old_shape, grid, num_prefix_tokens, key):
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(old_shape):
        return tensor
    out = resample_pos_embed(tensor, grid, num_prefix_tokens=num_prefix_tokens)
    return out.clamp_(min=0) if key in _NON_NEGATIVE_STATE else out


def set_image_size(module, size, optimizer=None, ema=None):
    """Switches the model (the plain module, not a parallel wrapper) to ``size`` px; carries
    optimizer state and EMA along. Returns whether anything changed."""
    if module.image_size == size:
        return False
    if not hasattr(module, "pos_embed"):  # a CNN: no parameter depends on the size
        module.set_image_size(size)
        return True
    pos = module.pos_embed
    old_shape = tuple(pos.shape)
    learned = isinstance(pos, torch.nn.Parameter)
    if learned:
        pos.grad = None  # a gradient of the old shape is meaningless now
    module.set_image_size(size)
    grid, prefix = module.grid_size, module.num_prefix_tokens
    if learned and optimizer is not None:
        state = optimizer.state.get(pos, {})
        for key, value in list(state.items()):
            state[key] = _resample_like(value, old_shape, grid, prefix, key)
    if ema is not None:
        named = dict(module.named_parameters())
        named.update(module.named_buffers())
        for i, name in enumerate(ema.names):
            if name.endswith("pos_embed") and ema.tensors[i].shape != named[name].shape:
                if learned:
                    ema.tensors[i] = resample_pos_embed(
                        ema.tensors[i], grid, num_prefix_tokens=prefix
                    )
                else:  # a fixed table: its average is itself
                    ema.tensors[i] = named[name].detach().float().clone()
    if learned and getattr(optimizer, "contiguous", False):
        # the flat buffers have the old size; built after the EMA, whose copies of the
        # parameters a one-pass optimizer keeps in buffers of its own
        optimizer.rebuild_contiguous()
    return True
