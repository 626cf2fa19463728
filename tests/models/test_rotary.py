"""The 2-D RoPE follows each image's own token grid: on every path that changes which tokens run
(patch dropout, a token batch padded or packed, an image-size change), each token is turned by the
angles the full-grid model turns it by, bit for bit; the class and register tokens are not turned.
And each kind's angles are the ones timm's modules compute (``timm.layers.pos_embed_sincos``)."""

import math

import pytest
import torch

from pycls.datasets.loading.token_batches import MicroBatchPlan, collate_token_batch
from pycls.models.vit import VisionTransformer, transformer
from pycls.models.vit.rotary import Rotary, grid_positions

P = 4
KINDS = {
    "axial": dict(rope="axial", rope_grid_indexing="xy"),
    "axial_ref_grid": dict(rope="axial", rope_ref_grid=8),
    "mixed": dict(rope="mixed"),
    "dinov3": dict(rope="dinov3", rope_layout="half"),
}


def _vit(kind, **kwargs):
    torch.manual_seed(0)
    args = dict(image_size=16, patch_size=P, depth=2, width=32, num_heads=2, mlp_dim=64,
                num_classes=5, num_registers=1, pos_embed="none")  # fmt: skip
    return VisionTransformer(**{**args, **KINDS[kind], **kwargs})


class Turns:
    """The angles every rotary attention of ``model`` turned its tokens by, per forward: a list
    (one per call) of (..., heads or 1, L, pairs) tensors, the first block's."""

    def __init__(self, model):
        self.angles = []
        rope = model.blocks[0].attn.rope
        rope.register_forward_hook(lambda m, args, out: self.angles.append(m.angles(args[2])))


def _full_grid_angles(kind, h, w):
    """The first block's angles of an image of h x w patches on its own, (heads or 1, L, pairs)."""
    model = _vit(kind).eval()
    turns = Turns(model)
    with torch.no_grad():
        model(torch.randn(1, 3, h * P, w * P))
    return turns.angles[0].reshape(-1, *turns.angles[0].shape[-2:])


@pytest.mark.parametrize("kind", list(KINDS))
def test_patch_dropout_turns_each_kept_token_as_the_full_grid(kind, monkeypatch):
    """Catches positions not gathered with the kept tokens (the first patches' angles given to
    whichever were kept) or gathered per batch instead of per image."""
    kept = []

    def recording(*args, **kwargs):
        out = drop(*args, **kwargs)
        kept.append(out[1])
        return out

    drop = transformer.drop_patches
    monkeypatch.setattr(transformer, "drop_patches", recording)
    model = _vit(kind, patch_drop=0.5).train()
    turns = Turns(model)
    model(torch.randn(3, 3, 16, 16))
    (index,) = kept
    full = _full_grid_angles(kind, 4, 4)  # (heads or 1, 2 + 16, pairs)
    got = turns.angles[0]  # (3, heads or 1, 2 + 8, pairs)
    assert got.shape[0] == 3 and got.shape[-2] == 2 + 8  # the class and register tokens, 8 kept
    for image in range(3):
        assert torch.equal(got[image], full[:, index[image]])
    assert not torch.equal(index[0], index[1])  # the images kept other patches
    assert torch.count_nonzero(got[:, :, :2]) == 0  # the class and register tokens: not turned


def _token_batch(images, pack, prefix=2):
    grids = [(im.shape[1] // P, im.shape[2] // P) for im in images]
    length = prefix + 16
    if pack:
        sequences = [0, 0, 1, 1]  # (2x3, 2x2) and (3x1, 1x1) share a sequence each
    else:
        sequences = list(range(len(images)))
    plan = MicroBatchPlan(tuple((i, 0, g) for i, g in enumerate(grids)), tuple(sequences),
                          max(sequences) + 1, length)  # fmt: skip
    batch, _, skipped = collate_token_batch([(im, 0) for im in images], plan, P, prefix, pack)
    assert skipped == 0
    return batch, sequences


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_token_batch_turns_each_image_as_its_own_grid(kind, pack):
    """Catches a token batch's positions taken from the canvas (the largest grid) or from one
    image's grid for all, or the next image of a packed sequence counted on from the first
    (dinov3's positions are normalised per grid: 2x3 and 2x2 differ)."""
    grids = [(2, 3), (2, 2), (3, 1), (1, 1)]
    images = [torch.randn(3, h * P, w * P) for h, w in grids]
    model = _vit(kind).eval()
    turns = Turns(model)
    batch, sequences = _token_batch(images, pack)
    with torch.no_grad():
        model(batch)
    got = turns.angles[0]  # (S, heads or 1, L, pairs)
    start = {}
    for image, ((h, w), seq) in enumerate(zip(grids, sequences)):
        first = start.get(seq, 0)
        count = 2 + h * w
        want = _full_grid_angles(kind, h, w)
        assert torch.equal(got[seq][:, first : first + count], want), (image, seq)
        start[seq] = first + count


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_image_size_change_turns_as_a_model_built_at_the_new_size(kind):
    """The curriculum's set_image_size: the 24 px grid's tokens are turned as a model of 24 px
    turns them, and 16 px ones as before. Catches positions cached for the first grid."""
    model = _vit(kind).eval()
    before = Turns(model)
    with torch.no_grad():
        model(torch.randn(1, 3, 16, 16))
        model.set_image_size(24)
        model(torch.randn(1, 3, 24, 24))
        model(torch.randn(1, 3, 16, 16))
    at_24 = _full_grid_angles(kind, 6, 6)
    assert torch.equal(before.angles[1].reshape(at_24.shape), at_24)
    assert torch.equal(before.angles[2], before.angles[0])
    assert model.image_size == 24 and model.pos_embed is None


# ---- each kind's angles against timm's modules ------------------------------------------------


def test_the_angles_are_timms():
    """Axial (with EVA's reference grid), DINOv3's and mixed against the sin and cos tables of
    timm's RotaryEmbeddingCat, RotaryEmbeddingDinoV3 and RotaryEmbeddingMixed, in both layouts of
    the pairs: the same float32 numbers."""
    from timm.layers import pos_embed_sincos as timm_rope

    head_dim, grid = 16, (3, 5)
    cases = [
        ("axial", dict(temperature=100.0, layout="interleaved"), dict(ref_grid=0, indexing="xy"),
         timm_rope.RotaryEmbeddingCat(head_dim, temperature=100.0, in_pixels=False,
                                      feat_shape=list(grid), grid_indexing="xy")),
        ("axial", dict(layout="interleaved"), dict(ref_grid=16, indexing="ij"),
         timm_rope.RotaryEmbeddingCat(head_dim, in_pixels=False, feat_shape=list(grid),
                                      ref_feat_shape=[16, 16])),
        ("dinov3", dict(temperature=100.0, layout="half"), dict(ref_grid=0, indexing="ij"),
         timm_rope.RotaryEmbeddingDinoV3(head_dim, temperature=100.0, feat_shape=list(grid),
                                         rotate_half=True)),
    ]  # fmt: skip
    for kind, rotary, grid_args, theirs in cases:
        ours = Rotary(kind, head_dim=head_dim, num_heads=2, **rotary)
        angles = ours.angles(grid_positions(kind, *grid, **grid_args))[0]
        half = rotary["layout"] == "half"
        sin, cos = theirs.get_embed().chunk(2, -1)
        layout = (
            (lambda x: torch.cat([x, x], -1)) if half else (lambda x: x.repeat_interleave(2, -1))
        )
        torch.testing.assert_close(layout(angles.sin()), sin, rtol=0, atol=1e-6)
        torch.testing.assert_close(layout(angles.cos()), cos, rtol=0, atol=1e-6)
    mixed = timm_rope.RotaryEmbeddingMixed(
        2 * head_dim, depth=1, num_heads=2, feat_shape=list(grid)
    )
    ours = Rotary("mixed", head_dim=head_dim, num_heads=2)
    with torch.no_grad():
        ours.freqs.copy_(mixed.freqs[:, 0])
    angles = ours.angles(grid_positions("mixed", *grid, indexing="xy"))
    sin, cos = mixed.get_embed()[0].chunk(2, -1)
    torch.testing.assert_close(angles.sin().repeat_interleave(2, -1), sin, rtol=0, atol=1e-6)
    assert math.isclose(ours.temperature, 10000.0)
