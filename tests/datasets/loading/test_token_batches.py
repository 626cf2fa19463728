"""The token budget's data side: the sampler's epoch plan (every process the same steps and caps,
disjoint images, budgets kept, exact resumption), loading and collating planned micro-batches (in
workers as in the main process, corrupt images skipped), and mixup / cutmix per image (exactly
torchvision's on a batch of one size)."""

import math

import pytest
import torch
from torchvision.transforms import v2

from pycls.datasets.loading.corrupt_samples import Skipped
from pycls.datasets.loading.loader import AugmentedDataset, sample_seed
from pycls.datasets.loading.token_batches import (
    TokenBatchMixer,
    TokenBudgetDataset,
    TokenBudgetSampler,
    TokenDeviceBatches,
    collate_token_batch,
    construct_token_loader,
    draw_grid,
)
from pycls.datasets.loading.transforms import BatchMixer
from pycls.models.vit.token_masks import TokenBatch

P = 4
SIZES = [8, 12, 16]  # caps of 4, 9 and 16 patches


def _sampler(n=400, **kwargs):
    args = dict(
        seed=3, patch_size=P, sizes=SIZES, budget=64, max_aspect=2.0, min_scale=0.25, num_prefix=1
    )
    return TokenBudgetSampler(n, **{**args, **kwargs})


def test_draw_grid_stays_under_the_cap():
    assert draw_grid(196, 0.3, 0.999999, 1.0, 1.0) == (14, 14)  # square at the cap
    for i in range(2000):
        ua, us = (i * 0.618) % 1, (i * 0.414) % 1
        h, w = draw_grid(196, ua, us, 2.0, 0.25)
        assert 1 <= h * w <= 196
        assert h * w >= 0.25 * 196 - math.sqrt(196 * 2.0)  # the sampler's closing rule


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_every_process_plans_the_same_steps_with_disjoint_images(pack):
    world, accum = 2, 2
    samplers = [_sampler(pack=pack, rank=r, world_size=world, accum=accum) for r in range(world)]
    plans = [s.plan(0) for s in samplers]
    assert len(plans[0]) == len(plans[1]) == samplers[0].steps_per_epoch * accum > 0
    seen = []
    for step in range(samplers[0].steps_per_epoch):
        micro = [p[step * accum : (step + 1) * accum] for p in plans]
        lengths = {m.sequence_length for ms in micro for m in ms}
        assert len(lengths) == 1  # one cap per step, in every process
        for ms in micro:
            for m in ms:
                cap = m.sequence_length - 1
                assert m.num_sequences == 64 // cap
                used = [0] * m.num_sequences
                for (index, _, (h, w)), q in zip(m.keys, m.sequences):
                    assert h * w <= cap
                    used[q] += 1 + h * w
                    seen.append(index)
                assert max(used) <= m.sequence_length
                if not pack:
                    assert len(m.keys) == m.num_sequences and list(m.sequences) == list(
                        range(m.num_sequences)
                    )
    assert len(seen) == len(set(seen))  # no image twice in epoch 0 (it never wraps)


def test_plans_are_reproducible_and_resume_after_skipped_micro_batches():
    a, b = _sampler(pack=True), _sampler(pack=True)
    a.set_epoch(2)
    b.set_epoch(2, skip=5)
    full, rest = list(a), list(b)
    assert full[5:] == rest and len(full) == len(a)
    a.set_epoch(3)
    assert list(a) != full and len(list(a)) == len(full)  # a new order, the same length
    # each image's seed is the one the plain sampler gives it: its augmentation is the same
    index, seed, _ = full[0].keys[0]
    assert seed == sample_seed(3, 2, index)


def test_packing_fits_more_images_than_padding():
    padded, packed = _sampler(pack=False), _sampler(pack=True)
    images = [sum(len(m.keys) for m in s.plan(0)) for s in (padded, packed)]
    steps = [s.steps_per_epoch for s in (padded, packed)]
    assert images[0] / steps[0] < images[1] / steps[1]


def test_sampler_refuses_a_budget_without_room_for_the_largest_image():
    with pytest.raises(ValueError, match="largest size 16 px"):
        _sampler(budget=15)


# ------------------------------------------------------------------------------------------------ #
# Loading
# ------------------------------------------------------------------------------------------------ #


class _Squares(torch.utils.data.Dataset):
    """Images whose pixels are their index; index 5 is corrupt."""

    def __len__(self):
        return 40

    def __getitem__(self, index):
        return torch.full((3, 20, 20), index, dtype=torch.uint8), index % 10


def _resize_to(size, train):
    return v2.Resize((size, size), antialias=True)


class _Corrupting(AugmentedDataset):
    def __getitem__(self, key):
        if key[0] == 5:
            return Skipped("image 5 is corrupt") if self.skip_corrupt else None
        return super().__getitem__(key)


def _loader(num_workers=0, pack=True, dataset_cls=AugmentedDataset):
    dataset = dataset_cls(_Squares(), _resize_to, train=True, skip_corrupt=True)
    sampler = TokenBudgetSampler(
        40,
        seed=0,
        patch_size=P,
        sizes=SIZES,
        budget=32,
        max_aspect=2.0,
        min_scale=0.25,
        pack=pack,
        num_prefix=1,
    )
    tokens = TokenBudgetDataset(dataset, patch_size=P, num_prefix=1, pack=pack)
    return construct_token_loader(
        tokens,
        sampler,
        num_workers=num_workers,
        pin_memory=False,
        persistent_workers=False,
        prefetch_factor=2,
        seed=0,
        skip_corrupt=True,
    )


def test_loader_collates_each_planned_micro_batch():
    loader = _loader()
    plans = loader.sampler.plan(0)
    assert len(loader) == len(plans)
    for plan, (batch, labels, skipped) in zip(plans, loader):
        assert isinstance(batch, TokenBatch)
        grids = [g for _, _, g in plan.keys]
        assert list(batch.image_grids) == grids and skipped == 0
        assert labels.tolist() == [i % 10 for i, _, _ in plan.keys]
        for i, (index, _, (h, w)) in enumerate(plan.keys):
            image = batch.canvas[i, :, : h * P, : w * P]
            assert (image == index).all()  # its own image, resized to its grid
        assert batch.segments.shape == (plan.num_sequences, plan.sequence_length)
        assert batch.counts == (sum(1 + h * w for h, w in grids), batch.segments.numel())


def test_workers_give_the_batches_of_the_main_process():
    def all_of(loader):
        return [(b.canvas, b.token_index, lbl) for b, lbl, _ in loader]

    for a, b in zip(all_of(_loader(0)), all_of(_loader(1)), strict=True):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_a_corrupt_image_is_skipped_and_named():
    loader = _loader(dataset_cls=_Corrupting)
    found = False
    for plan, (batch, labels, skipped) in zip(loader.sampler.plan(0), loader):
        indices = [i for i, _, _ in plan.keys]
        if 5 in indices:
            found = True
            assert skipped == 1 and skipped.reasons == ("image 5 is corrupt",)
            assert labels.numel() == len(indices) - 1 == batch.num_images
    assert found


def test_all_skipped_micro_batch_is_the_empty_batch():
    plan = TokenBudgetSampler(4, seed=0, patch_size=P, sizes=[8], budget=4).plan(0)[0]
    images, labels, skipped = collate_token_batch([Skipped("gone")], plan, P, 1, False)
    assert images.shape == (0, 3, 0, 0) and labels.numel() == 0 and skipped == 1


def test_device_batches_normalise_the_canvas():
    loader = _loader()
    batch, labels, _ = next(iter(TokenDeviceBatches(loader, "cpu", [0.5] * 3, [0.25] * 3)))
    raw, _, _ = next(iter(loader))
    assert batch.canvas.dtype == torch.float32
    torch.testing.assert_close(batch.canvas, (raw.canvas.float() - 127.5) / 63.75)
    assert torch.equal(batch.token_index, raw.token_index)


# ------------------------------------------------------------------------------------------------ #
# Mixup / CutMix per image
# ------------------------------------------------------------------------------------------------ #


def _uniform_batch(n=6, grid=(4, 4)):
    plan = TokenBudgetSampler(n, seed=0, patch_size=P, sizes=[16], budget=16 * n).plan(0)[0]
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randn(3, 16, 16, generator=g), i) for i in range(n)]
    batch, labels, _ = collate_token_batch(samples, plan, P, 0, False)
    return batch, labels


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_token_mixer_is_torchvisions_on_a_batch_of_one_size(kind):
    batch, labels = _uniform_batch()
    alphas = {"mixup_alpha": 0.8} if kind == "mixup" else {"cutmix_alpha": 1.0}
    mine = TokenBatchMixer(10, patch_size=P, **alphas)
    theirs = BatchMixer(10, **alphas)
    for seed in range(5):
        torch.manual_seed(seed)
        mixed, targets = mine(batch, labels)
        torch.manual_seed(seed)
        want_images, want_targets = theirs(batch.canvas, labels)
        assert torch.equal(mixed.canvas, want_images)
        torch.testing.assert_close(targets, want_targets)


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_token_mixer_mixes_images_of_other_sizes_per_image(kind):
    grids = [(4, 4), (2, 3), (3, 2), (1, 4)]
    plan = TokenBudgetSampler(4, seed=0, patch_size=P, sizes=[16], budget=64).plan(0)[0]
    plan = plan._replace(keys=tuple((i, 0, g) for i, g in enumerate(grids)))
    samples = [(torch.full((3, h * P, w * P), float(i + 1)), i) for i, (h, w) in enumerate(grids)]
    batch, labels, _ = collate_token_batch(samples, plan, P, 0, False)
    alphas = {"mixup_alpha": 0.8} if kind == "mixup" else {"cutmix_alpha": 1.0}
    torch.manual_seed(1)
    mixed, targets = TokenBatchMixer(10, patch_size=P, **alphas)(batch, labels)
    torch.testing.assert_close(targets.sum(1), torch.ones(4))
    for i, (h, w) in enumerate(grids):
        own, partner = float(i + 1), float((i - 1) % 4 + 1)
        region = mixed.canvas[i, :, : h * P, : w * P]
        lam = float(targets[i, i])
        # every pixel of the image is a mix of its own value and its partner's (resized)
        if kind == "mixup":
            torch.testing.assert_close(
                region, torch.full_like(region, lam * own + (1 - lam) * partner)
            )
        else:
            share = float((region == partner).float().mean())
            assert float(((region == own) | (region == partner)).float().mean()) == 1.0
            assert share == pytest.approx(1 - lam)
