"""Groups of a model's parameters, from their names and modules: which take no weight decay,
which layer each belongs to (layer-wise learning-rate decay: ``layer_ids``), which a fine-tuning
freezes.
"""

from torch import nn

from pycls.models.layer_ids import BLOCK_NAME, layer_id, parse_freeze

# Normalisation layers: their parameters take no weight decay (the model's and the optimizer's
# rule both use this tuple), and they stay in fp32 under AMP O2 (pycls.engines.precision)
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def keeps_float32(module):
    """Whether AMP O2 leaves ``module``'s tensors in float32 when it casts the weights to half:
    the norms, and a module that says so with ``keeps_float32 = True`` (the ViT's drop-path
    rates, which rounded to bfloat16 would change what a rate means)."""
    return isinstance(module, NORM_TYPES) or getattr(module, "keeps_float32", False)


def named_saved_buffers(model):
    """(name, buffer) of the buffers ``model.state_dict()`` holds, in its order, read from each
    module's own record without calling ``state_dict()`` (which gathers the whole model under
    some engines): not the non-persistent ones (the drop-path rates), which are settings a
    module rebuilds, not weights."""
    for prefix, module in model.named_modules():
        transient = module._non_persistent_buffers_set
        for name, b in module.named_buffers(recurse=False):
            if name not in transient:
                yield (f"{prefix}.{name}" if prefix else name), b


def freeze(model, value: str, depth: int) -> list[str]:
    """Applies TRAIN.FREEZE: turns off gradients of everything before the trainable part.

    "head" leaves the classifier (``head``, a distilled ViT's ``head_dist``, ``pre_logits``)
    trainable, a linear probe when there is no pre-logits layer; "last_k" also the last k blocks
    and the final norms. Returns
    the names of the frozen parameters. Call it before the optimizer and the parallel engine
    are built: both only take parameters that require gradients.
    """
    keep_blocks = parse_freeze(value, depth)
    if keep_blocks is None:
        return []
    frozen = []
    for name, p in model.named_parameters():
        layer = layer_id(name, depth)
        if keep_blocks == 0:
            trainable = name.split(".")[0] in ("head", "head_dist", "pre_logits")
        else:
            trainable = layer > depth - keep_blocks
        if not trainable:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def no_weight_decay_names(model):
    """Names of parameters that take no weight decay: norms, biases, embeddings and tokens.

    A model may declare its own through ``no_weight_decay_names()``; otherwise every parameter of
    a normalisation layer and every 1-d parameter (biases, scales) is excluded.
    """
    if hasattr(model, "no_weight_decay_names"):
        return set(model.no_weight_decay_names())
    names = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if isinstance(module, NORM_TYPES) or p.ndim <= 1:
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def hidden_matrix_names(model):
    """Names of the hidden 2-D weights: the matrices inside the transformer blocks (attention and
    feed-forward projections), which Muon orthogonalises. The patch embedding, the head, the
    position embedding and the tokens sit outside the blocks; norms and biases are not 2-D.
    From the names, so FSDP2, DDP and torch.compile (which keep them) change nothing."""
    return {n for n, p in model.named_parameters() if p.ndim == 2 and BLOCK_NAME.search(n)}
