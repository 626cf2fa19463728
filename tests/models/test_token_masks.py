"""Fewer tokens through the ViT, each against a reference: patch dropout against the unmasked model
(evaluation identical, training a subset of its tokens), token batches (padded and packed) against
each image's own forward pass (logits to 1e-5 in fp32, the same gradients), compute-skipping
stochastic depth against the multiply-by-zero drop path (exactly, for a fixed mask; in
expectation, for random ones), and the FLOPs counted for each against torch's FlopCounterMode."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pycls.datasets.loading.token_batches import MicroBatchPlan, collate_token_batch
from pycls.models.vit import VisionTransformer, token_masks
from pycls.models.vit.blocks import DropPath, EncoderBlock
from pycls.models.vit.complexity import vit_run_flops

P = 4  # patch size of the test models


def _counted_flops(model, x):
    """FlopCounterMode's FLOPs of a forward pass, attention on SDPA's math backend (bmm on every
    torch version: the fused CPU kernels are counted by some versions only, see
    test_complexity.counted_flops)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(x)
    return counter.get_total_flops()


def _vit(**kwargs):
    torch.manual_seed(0)
    args = dict(
        image_size=16,
        patch_size=P,
        depth=2,
        width=32,
        num_heads=2,
        mlp_dim=64,
        num_classes=7,
        head_init_scale=1.0,
    )
    model = VisionTransformer(**{**args, **kwargs})
    # a non-zero head and embedding, so that the logits depend on every token
    return model.double() if kwargs.pop("double", False) else model


# ------------------------------------------------------------------------------------------------ #
# Patch dropout
# ------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize("classifier", ["token", "pooled"])
def test_patch_dropout_evaluates_every_token(classifier):
    """In evaluation a model with patch dropout is the model without it, bit for bit."""
    images = torch.randn(3, 3, 16, 16)
    dropping = _vit(classifier=classifier, patch_drop=0.75).eval()
    plain = _vit(classifier=classifier).eval()
    plain.load_state_dict(dropping.state_dict())
    assert torch.equal(dropping(images), plain(images))


@pytest.mark.parametrize("layout", ["batch_first", "batch_second"])
@pytest.mark.parametrize("registers", [0, 2])
def test_patch_dropout_keeps_prefix_tokens_and_a_subset_of_each_images_patches(layout, registers):
    model = _vit(patch_drop=0.5, layout=layout, num_registers=registers)
    images = torch.randn(4, 3, 16, 16)
    model.eval()
    full = model.embed(images)
    model.train()
    kept = model.embed(images)
    if layout == "batch_second":
        full, kept = full.transpose(0, 1), kept.transpose(0, 1)
    prefix = 1 + registers
    assert kept.shape == (4, prefix + 8, 32)  # 16 patches, half kept
    assert torch.equal(kept[:, :prefix], full[:, :prefix])
    subsets = set()
    for i in range(4):
        rows = [int((full[i, prefix:] == t).all(dim=1).nonzero()) for t in kept[i, prefix:]]
        assert len(set(rows)) == 8  # distinct patches of that image, with their own positions
        subsets.add(tuple(sorted(rows)))
    assert len(subsets) > 1  # each image draws its own


def test_patch_dropout_flops_are_counted_at_the_kept_tokens():
    for classifier in ("token", "pooled"):
        model = _vit(classifier=classifier, patch_drop=0.75).train()
        counted = _counted_flops(model, torch.randn(2, 3, 16, 16))
        prefix = model.num_prefix_tokens
        flops = vit_run_flops(model.arch, stem_patches=16, sequence_lengths=[prefix + 4], images=1)
        assert counted == 2 * 2 * flops
        full = model.complexity()["flops"]
        assert (
            vit_run_flops(model.arch, stem_patches=16, sequence_lengths=[prefix + 16], images=1)
            == full
        )
        assert flops < full


def test_set_patch_drop_checks_its_rate():
    model = _vit()
    model.set_patch_drop(0.5)
    assert model.patch_drop == 0.5 and model.arch["patch_drop"] == 0.5
    with pytest.raises(ValueError, match="patch_drop"):
        model.set_patch_drop(1.0)
    with pytest.raises(ValueError, match="ffn 'local'"):
        _vit(ffn="local", patch_drop=0.5)


# ------------------------------------------------------------------------------------------------ #
# Token batches: padded and packed against each image on its own
# ------------------------------------------------------------------------------------------------ #

# (h, w) patch grids: rectangular ones, the model's own 4x4, smaller ones
GRIDS = [(4, 4), (2, 3), (3, 1), (1, 1), (4, 2), (2, 2)]


def _images(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h * P, w * P, generator=g, dtype=torch.float64) for h, w in grids]


def _token_batch(images, *, pack, num_prefix, cap=16):
    """A TokenBatch of ``images`` (float), padded (one per sequence) or packed first-fit."""
    grids = [(im.shape[1] // P, im.shape[2] // P) for im in images]
    length = cap + num_prefix
    if pack:
        sequences, free = [], []
        for h, w in grids:
            need = num_prefix + h * w
            spot = next((i for i, f in enumerate(free) if f >= need), None)
            if spot is None:
                spot = len(free)
                free.append(length)
            free[spot] -= need
            sequences.append(spot)
        num_sequences = len(free) + 1  # one all-padding sequence too
    else:
        sequences, num_sequences = list(range(len(images))), len(images) + 1
    keys = tuple((i, 0, g) for i, g in enumerate(grids))
    plan = MicroBatchPlan(keys, tuple(sequences), num_sequences, length)
    samples = [(im, i % 7) for i, im in enumerate(images)]
    batch, labels, skipped = collate_token_batch(samples, plan, P, num_prefix, pack)
    assert skipped == 0
    return batch, labels


def _each_alone(model, images):
    return torch.cat([model(im[None]) for im in images])


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    "options",
    [
        dict(classifier="pooled"),
        dict(classifier="token"),
        dict(classifier="pooled", class_token=True, num_registers=2, layout="batch_second"),
        dict(classifier="token", pos_embed="sincos", fc_norm=True, pre_norm=True),
        dict(rope="axial", pos_embed="none", rope_grid_indexing="xy", qk_norm="layer"),
        dict(rope="dinov3", rope_layout="half", num_registers=1, layout="batch_second"),
        dict(rope="mixed", classifier="map", ffn="swiglu", layer_scale_init=0.5),
        dict(classifier="map", class_token=False, block="parallel", norm_layer="rms"),
    ],
    ids=[
        "pooled",
        "token",
        "registers_batch_second",
        "sincos",
        "rope_axial",
        "rope_dinov3",
        "rope_mixed_map_swiglu",
        "map_parallel_rms",
    ],
)
def test_token_batch_gives_each_image_its_own_logits_and_gradients(pack, options):
    images = _images(GRIDS)
    reference = _vit(**options).double()
    model = _vit(**options).double()
    model.load_state_dict(reference.state_dict())
    batch, labels = _token_batch(images, pack=pack, num_prefix=model.num_prefix_tokens)
    if pack:
        assert batch.segments.shape[0] < len(images)  # several images share a sequence
    want = _each_alone(reference, images)
    got = model(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    F.cross_entropy(want, labels, reduction="sum").backward()
    F.cross_entropy(got, labels, reduction="sum").backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_token_batch_logits_in_float32_within_1e_5(pack):
    images = [im.float() for im in _images(GRIDS, seed=1)]
    model = _vit(classifier="pooled", layout="batch_second").eval()
    batch, _ = _token_batch(images, pack=pack, num_prefix=0)
    torch.testing.assert_close(model(batch), _each_alone(model, images), rtol=0, atol=1e-5)


@pytest.mark.skipif(not token_masks.has_flex_attention(), reason="torch without FlexAttention")
def test_flex_attention_block_mask_matches_the_sdpa_mask():
    images = [im.float() for im in _images(GRIDS, seed=2)]
    sdpa = _vit(classifier="token").eval()
    flex = _vit(classifier="token", packed_attention="flex").eval()
    flex.load_state_dict(sdpa.state_dict())
    batch, _ = _token_batch(images, pack=True, num_prefix=1)
    assert isinstance(token_masks.sequence_mask(batch, "flex"), token_masks.BlockMask)
    with torch.no_grad():  # FlexAttention has no backward on the CPU (the config refuses it)
        torch.testing.assert_close(flex(batch), sdpa(batch), rtol=0, atol=1e-5)


def test_whole_unpadded_sequences_need_no_mask():
    images = _images([(4, 4)] * 3)
    batch, _ = _token_batch(images, pack=False, num_prefix=1)
    assert token_masks.sequence_mask(batch, "sdpa") is not None  # the all-padding sequence
    plan = MicroBatchPlan(tuple((i, 0, (4, 4)) for i in range(3)), (0, 1, 2), 3, 17)
    whole, _, _ = collate_token_batch([(im, 0) for im in images], plan, P, 1, False)
    assert not whole.padded and token_masks.sequence_mask(whole, "sdpa") is None


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_token_batch_flops_match_the_flop_counter(pack):
    images = [im.float() for im in _images(GRIDS, seed=3)]
    model = _vit(classifier="token").eval()
    batch, _ = _token_batch(images, pack=pack, num_prefix=1)
    counted = _counted_flops(model, batch)
    rows, cols = (side // P for side in batch.canvas.shape[-2:])
    s, length = batch.segments.shape
    flops = vit_run_flops(
        model.arch,
        stem_patches=len(images) * rows * cols,
        sequence_lengths=[length] * s,
        images=len(images),
    )
    assert counted == 2 * flops


def test_rectangular_images_resample_the_position_embedding():
    model = _vit(classifier="pooled").eval()
    image = torch.randn(1, 3, 8, 12)
    table = model._pos_embed_for((8, 12))
    assert table.shape == (1, 6, 32)
    assert model(image).shape == (1, 7)
    with pytest.raises(ValueError, match="square"):
        _vit(ffn="local")._pos_embed_for((8, 12))


def test_token_batches_refuse_what_they_cannot_run():
    images = _images([(2, 2), (3, 3)])
    batch, _ = _token_batch([im.float() for im in images], pack=False, num_prefix=1)
    with pytest.raises(ValueError, match="ffn other than 'local' and stem 'patchify'"):
        _vit(ffn="local")(batch)
    with pytest.raises(ValueError, match="patch_drop"):
        _vit(patch_drop=0.5).train()(batch)


# ------------------------------------------------------------------------------------------------ #
# Compute-skipping stochastic depth
# ------------------------------------------------------------------------------------------------ #


def _block(mode, p=0.5, batch_first=True):
    torch.manual_seed(1)
    return EncoderBlock(
        width=16, num_heads=2, mlp_dim=32, drop_path=p, drop_path_mode=mode, batch_first=batch_first
    ).double()


@pytest.mark.parametrize("batch_first", [True, False])
def test_skip_equals_multiply_by_zero_for_a_fixed_mask(batch_first):
    """The kept samples' branch added with scale n / kept is x + branch(x) * m for the mask m
    (scale on the kept samples, 0 elsewhere): the same output and the same gradients."""
    block = _block("skip", batch_first=batch_first)
    dim = 0 if batch_first else 1
    x = torch.randn(6, 5, 16, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1).contiguous()
    kept, scale = torch.tensor([4, 0, 2]), 2.0
    mask = torch.zeros(6, dtype=torch.float64).index_fill_(0, kept, scale)
    shape = [1, 1, 1]
    shape[dim] = 6
    seg = torch.tensor([[0, 0, 1, 1, -1]] * 6)  # a packed-style mask, one per sequence
    attn_mask = seg[:, None, :, None] == seg[:, None, None, :]

    def skipping(x):
        return token_masks.add_kept_residual(
            x, block._attention_branch, kept, scale, batch_dim=dim, attn_mask=attn_mask
        )

    def multiplying(x):
        return x + block._attention_branch(x, attn_mask) * mask.view(shape)

    grads = []
    for fn in (skipping, multiplying):
        block.zero_grad()
        xi = x.clone().requires_grad_()
        out = fn(xi)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append(
            (
                out.detach(),
                xi.grad,
                [p.grad.clone() for p in block.parameters() if p.grad is not None],
            )
        )
    (o1, g1, p1), (o2, g2, p2) = grads
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)
    assert len(p1) == len(p2) > 0
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_skip_block_draws_its_kept_samples_and_matches_the_masked_block():
    """A block in skip mode is the multiply block with the masks its own draws make."""
    block = _block("skip", p=0.5)
    x = torch.randn(8, 5, 16, dtype=torch.float64)
    torch.manual_seed(7)
    got = block.train()(x)
    torch.manual_seed(7)
    masks = []
    for _ in range(2):  # the attention branch's draw, then the feed-forward's
        kept = torch.randperm(8)[:4]
        masks.append(torch.zeros(8, dtype=torch.float64).index_fill_(0, kept, 2.0).view(8, 1, 1))
    want = x + block._attention_branch(x) * masks[0]
    want = want + block._ffn_branch(want) * masks[1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_skip_and_multiply_agree_in_expectation_and_gradient():
    """Averaged over many draws, both drop paths give x + branch(x) and its gradient (a linear
    branch: the expectation is exact); each single draw of skip computes only the kept half."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4, bias=False).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    want = x + lin(x)
    (want.sum()).backward()
    want_grad, lin.weight.grad = lin.weight.grad.clone(), None
    draws = 4000
    calls = []

    def branch(sub, mask=None):
        calls.append(sub.shape[0])
        return lin(sub)

    drop = DropPath(0.5).train()
    for name, fn in (
        ("skip", lambda: token_masks.skip_residual(x, branch, 0.5)),
        ("multiply", lambda: x + drop(lin(x))),
    ):
        total = torch.zeros_like(x)
        for _ in range(draws):
            out = fn()
            out.sum().backward()
            total += out.detach()
        torch.testing.assert_close(total / draws, want, rtol=0, atol=0.15, msg=name)
        torch.testing.assert_close(
            lin.weight.grad / draws, want_grad, rtol=0.05, atol=0.1, msg=name
        )
        lin.weight.grad = None
    assert set(calls) == {4}  # 8 samples, half kept: the branch never sees the others


def test_skip_refuses_a_block_mask_and_keeps_one_sample_at_least():
    x = torch.randn(1, 3, 4)
    out = token_masks.skip_residual(x, lambda s, m: s, 0.9)
    torch.testing.assert_close(out, 2 * x)  # the only sample kept, scale 1
    with pytest.raises(ValueError, match="BlockMask"):
        token_masks.add_kept_residual(x, lambda s, m: s, torch.tensor([0]), 1.0, attn_mask=object())


def test_multiply_mode_and_no_drop_path_are_todays_block():
    block = _block("multiply", p=0.0).eval()
    x = torch.randn(4, 5, 16, dtype=torch.float64)
    want = x + block.attn(block.ln_1(x))
    want = want + block.ffn(block.ln_2(want))
    assert torch.equal(block(x), want)
    with pytest.raises(ValueError, match="drop_path_mode"):
        _block("never")
