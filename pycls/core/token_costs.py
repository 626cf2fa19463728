"""What a ViT trained on fewer tokens costs, counted honestly: the FLOPs per image of the work its
blocks really do (patch dropout's kept tokens; a token batch's sequences, padding included; the
branches that compute-skipping stochastic depth runs), for ``--mode info``, ``--mode time`` and
the trainer's complexity line; and the token batch ``--mode time`` steps on (the first
micro-batch the token budget's sampler plans, of random images), so that the timed step is the
step training runs.
"""

import torch

from pycls import distributed as dist
from pycls.core import builders
from pycls.datasets.loading.token_batches import synthetic_token_batch as planned_stand_in
from pycls.models.vit.complexity import vit_run_flops
from pycls.models.vit.token_masks import TokenBatch, kept_patches

# Images a token budget's stand-in sampler plans over, per budgeted patch: enough for a step
# whatever the grids (an image has at least one patch)
_PLANNED = 2


def fewer_tokens(cfg):
    """Whether the config trains a ViT with less work than its images' tokens ask (patch dropout,
    a token budget, compute-skipping stochastic depth)."""
    v = cfg.VIT
    skip = v.DROP_PATH_MODE == "skip" and v.DROP_PATH > 0
    return cfg.MODEL.TYPE == "vit" and (v.PATCH_DROP > 0 or cfg.TRAIN.TOKEN_BUDGET > 0 or skip)


def block_fractions(model, n):
    """Per block, the fraction of a batch of ``n`` samples (sequences) whose branches run while
    training: the kept ones under drop_path_mode "skip", all otherwise (None when all run)."""
    fractions = []
    for block in model.blocks:
        p = block.drop_path.p
        skip = block.drop_path_mode == "skip" and p > 0 and n > 0
        fractions.append(max(1, int(n * (1.0 - p))) / n if skip else 1.0)
    return fractions if any(f < 1 for f in fractions) else None


def _stand_in_sampler(cfg):
    return builders.build_token_sampler(cfg, _PLANNED * cfg.TRAIN.TOKEN_BUDGET + 1)


def _token_flops(model, n, rows, cols, num_sequences, length, training):
    fractions = block_fractions(model, num_sequences) if training else None
    return vit_run_flops(
        model.arch,
        stem_patches=n * rows * cols,
        sequence_lengths=[length] * num_sequences,
        images=n,
        block_fractions=fractions,
    )


def effective_complexity(cfg, model):
    """Per image while training: ``flops_effective`` (multiply-adds, as ``complexity``'s
    ``flops``) and ``tokens_per_image`` (the positions its blocks compute, prefix and padding
    included). Patch dropout and skipping are counted at TRAIN.IM_SIZE, VIT.PATCH_DROP and this
    process's micro-batch; a token budget over every micro-batch its sampler plans for an epoch
    of stand-in images (the caps and grids vary by step). {} when none of them is on."""
    if not fewer_tokens(cfg):
        return {}
    if cfg.TRAIN.TOKEN_BUDGET > 0:
        flops = images = positions = 0
        for plan in _stand_in_sampler(cfg).plan(0):
            rows = max(h for _, _, (h, w) in plan.keys)
            cols = max(w for _, _, (h, w) in plan.keys)
            n, s, length = len(plan.keys), plan.num_sequences, plan.sequence_length
            flops += _token_flops(model, n, rows, cols, s, length, training=True)
            images, positions = images + n, positions + s * length
        return {"flops_effective": flops / images, "tokens_per_image": positions / images}
    t = cfg.TRAIN
    micro = max(1, t.BATCH_SIZE // (dist.get_world_size() * t.ACCUM_STEPS))
    grid = (t.IM_SIZE // cfg.VIT.PATCH_SIZE) ** 2
    patches = kept_patches(grid, cfg.VIT.PATCH_DROP) if cfg.VIT.PATCH_DROP > 0 else grid
    length = model.num_prefix_tokens + patches
    arch = dict(model.arch, image_size=t.IM_SIZE)
    flops = vit_run_flops(
        arch,
        stem_patches=grid,
        sequence_lengths=[length],
        images=1,
        block_fractions=block_fractions(model, micro),
    )
    return {"flops_effective": flops, "tokens_per_image": length}


def flops_per_image(model, images, im_size, *, training):
    """Multiply-adds per image of one forward pass of ``model`` (an nn.Module with
    ``complexity``) on ``images`` (a batch tensor at ``im_size`` or a TokenBatch), in training
    (patch dropout and skipping applied) or evaluation."""
    if isinstance(images, TokenBatch):
        rows, cols = (side // model.patch_size for side in images.canvas.shape[-2:])
        s, length = images.segments.shape
        n = images.num_images
        return _token_flops(model, n, rows, cols, s, length, training) / n
    if not (training and hasattr(model, "patch_drop")):
        return model.complexity(im_size)["flops"]
    rate, fractions = model.patch_drop, block_fractions(model, images.shape[0])
    if rate == 0 and fractions is None:
        return model.complexity(im_size)["flops"]
    grid = (im_size // model.patch_size) ** 2
    length = model.num_prefix_tokens + (kept_patches(grid, rate) if rate > 0 else grid)
    arch = dict(model.arch, image_size=im_size)
    return vit_run_flops(
        arch, stem_patches=grid, sequence_lengths=[length], images=1, block_fractions=fractions
    )


def synthetic_token_batch(cfg, device):
    """``(TokenBatch, labels)`` on ``device``: this process's first planned micro-batch of a
    token budget, random normal images on its canvas (as normalised device batches are)."""
    batch, labels = planned_stand_in(_stand_in_sampler(cfg), cfg.MODEL.NUM_CLASSES)
    batch = batch._replace(canvas=torch.randn(batch.canvas.shape))
    return batch.to(device), labels.to(device)
