"""The seeded sampler, exact resumable augmentation, and device batches."""

import functools
from collections import Counter

import pytest
import torch

from pycls.datasets import (
    AugmentedDataset,
    DeviceBatches,
    Digits,
    SeededSampler,
    Synthetic,
    build_transform,
    collate_skipping,
    construct_loader,
    sample_seed,
)

# ---------------------------------------------------------------------------------------------
# Sampler


def _indices(sampler):
    return [index for index, _, _ in sampler]


def _ranks(num_samples, world_size, epoch=0, **kwargs):
    samplers = [
        SeededSampler(num_samples, rank=r, world_size=world_size, image_size=8, **kwargs)
        for r in range(world_size)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers


def test_sampler_shards_cover_every_index_once():
    for epoch in (0, 3):
        samplers = _ranks(10, 2, epoch=epoch, shuffle=True, seed=5)
        shards = [_indices(s) for s in samplers]
        assert [len(s) for s in samplers] == [5, 5] == [len(shard) for shard in shards]
        assert sorted(shards[0] + shards[1]) == list(range(10))


def test_sampler_pads_by_wrapping_and_drops_tail():
    samplers = _ranks(11, 2, shuffle=True, seed=5)
    shards = [_indices(s) for s in samplers]
    assert [len(s) for s in samplers] == [6, 6] == [len(shard) for shard in shards]
    counts = Counter(shards[0] + shards[1])
    assert set(counts) == set(range(11))
    # The padding repeats the head of the permutation, as DistributedSampler does.
    full = _indices(SeededSampler(11, shuffle=True, seed=5, image_size=8))
    assert [i for i, c in counts.items() if c == 2] == [full[0]]

    samplers = _ranks(11, 2, shuffle=True, seed=5, drop_last=True)
    shards = [_indices(s) for s in samplers]
    assert [len(s) for s in samplers] == [5, 5] == [len(shard) for shard in shards]
    assert len(set(shards[0] + shards[1])) == 10

    # Fewer samples than ranks: padding wraps more than once.
    shards = [_indices(s) for s in _ranks(2, 4, shuffle=False, seed=0)]
    assert shards == [[0], [1], [0], [1]]


def test_sampler_order_depends_on_epoch_only():
    a = SeededSampler(50, shuffle=True, seed=1, image_size=8)
    b = SeededSampler(50, shuffle=True, seed=1, image_size=8)
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b)
    assert list(a) == list(a)  # iterating again replays the epoch
    b.set_epoch(5)
    assert _indices(a) != _indices(b)
    assert sorted(_indices(b)) == list(range(50))
    unshuffled = SeededSampler(50, shuffle=False, seed=1, image_size=8)
    unshuffled.set_epoch(7)
    assert _indices(unshuffled) == list(range(50))


def test_sampler_keys():
    sampler = SeededSampler(20, shuffle=True, seed=9, image_size=24)
    sampler.set_epoch(2)
    keys = list(sampler)
    assert all(size == 24 and seed == sample_seed(9, 2, i) for i, seed, size in keys)
    seeds = [seed for _, seed, _ in keys]
    assert len(set(seeds)) == 20 and all(0 <= s < 2**63 for s in seeds)
    # The seed depends on (seed, epoch, index) only, not on the rank layout.
    rank1 = _ranks(20, 2, epoch=2, shuffle=True, seed=9)[1]
    assert all(seed == sample_seed(9, 2, i) for i, seed, _ in rank1)
    assert sample_seed(9, 3, 0) != sample_seed(9, 2, 0) != sample_seed(10, 2, 0)
    sampler.set_image_size(32)
    assert {size for _, _, size in sampler} == {32}


def test_sampler_bad_rank():
    with pytest.raises(ValueError, match="rank"):
        SeededSampler(10, shuffle=False, seed=0, image_size=8, rank=2, world_size=2)


# ---------------------------------------------------------------------------------------------
# Exact, resumable augmentation


def _loader(dataset, num_workers, image_size=16, persistent=False, **kwargs):
    options = dict(
        batch_size=8,
        shuffle=True,
        drop_last=False,
        num_workers=num_workers,
        pin_memory=False,
        persistent_workers=persistent,
        prefetch_factor=2,
        seed=3,
        image_size=image_size,
    )
    return construct_loader(dataset, **(options | kwargs))


def _epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return [batch for batch in loader]


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for (xa, ya, sa), (xb, yb, sb) in zip(batches_a, batches_b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and sa == sb


@pytest.fixture(scope="module")
def digits_train():
    base = torch.utils.data.Subset(Digits("train"), range(60))  # small keeps worker runs fast
    return AugmentedDataset(base, functools.partial(build_transform, "digits"), train=True)


def test_augmentation_independent_of_workers_and_history(digits_train):
    # Resumed at epoch 2 in a fresh single-process loader ...
    resumed = _epoch(_loader(digits_train, 0), 2)
    # ... equals epoch 2 of an uninterrupted run with persistent workers.
    loader = _loader(digits_train, 2, persistent=True)
    epochs = [_epoch(loader, e) for e in range(3)]
    _assert_same(resumed, epochs[2])
    # And the epochs differ from each other (augmentation and order change).
    assert not torch.equal(epochs[1][0][0], epochs[2][0][0])
    # Same data, augmented: not the raw images.
    assert resumed[0][0].shape == (8, 3, 16, 16)
    # Two workers without persistence, and replaying an epoch, agree too.
    _assert_same(_epoch(_loader(digits_train, 2), 2), resumed)
    _assert_same(_epoch(_loader(digits_train, 0), 2), resumed)


def test_loading_does_not_touch_main_rng(digits_train):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    _epoch(_loader(digits_train, 0), 0)
    assert torch.equal(torch.rand(3), expected)


def test_loading_seeds_only_the_cpu_generator(digits_train, monkeypatch):
    """Per-sample seeding must not go through torch.manual_seed: in the main process (no
    workers) that would reseed the GPU's generator (dropout) once per sample, and before CUDA is
    initialised each call queues a lazy call with a captured stack (~4 ms per sample)."""

    def reseeds_every_device(seed):
        raise AssertionError("data loading called torch.manual_seed")

    monkeypatch.setattr(torch, "manual_seed", reseeds_every_device)
    batches = _epoch(_loader(digits_train, 0), 0)
    assert batches and all(images.dtype == torch.uint8 for images, *_ in batches)


def test_image_size_changes_with_persistent_workers(digits_train):
    loader = _loader(digits_train, 2, persistent=True)
    first = _epoch(loader, 0)
    assert first[0][0].shape[-2:] == (16, 16)
    loader.sampler.set_image_size(24)
    second = _epoch(loader, 1)
    assert {batch[0].shape[-2:] for batch in second} == {(24, 24)}
    # And it is the same as a fresh loader started at that size and epoch.
    _assert_same(second, _epoch(_loader(digits_train, 0, image_size=24), 1))


def test_loader_sharding_and_lengths(digits_train):
    shards = [
        _epoch(_loader(digits_train, 0, rank=r, world_size=2, batch_size=7, drop_last=True), 0)
        for r in range(2)
    ]
    assert [len(s) for s in shards] == [4, 4]  # 30 per rank -> 4 full batches of 7
    loader = _loader(digits_train, 0, rank=0, world_size=2, batch_size=7)
    assert len(loader) == 5 == len(_epoch(loader, 0))


def test_loader_rejects_raw_dataset():
    with pytest.raises(TypeError, match="AugmentedDataset"):
        _loader(Digits("test"), 0)


def test_collate_skipping():
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    images, labels, skipped = collate_skipping([(image, 1), None, (image + 1, 2)])
    assert images.shape == (2, 3, 4, 4) and images.dtype == torch.uint8
    assert labels.tolist() == [1, 2] and labels.dtype == torch.int64 and skipped == 1
    images, labels, skipped = collate_skipping([None, None])
    assert images.shape[0] == 0 and labels.shape == (0,) and skipped == 2


# ---------------------------------------------------------------------------------------------
# Device batches


def test_device_batches_normalise_on_cpu():
    base = Synthetic(20, 12, 5, seed=0)
    dataset = AugmentedDataset(base, functools.partial(build_transform, "none"), train=False)
    loader = _loader(dataset, 0, image_size=12, shuffle=False)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    batches = DeviceBatches(loader, "cpu", mean, std)
    assert len(batches) == len(loader) == 3
    count = 0
    for (images, labels, skipped), (raw, raw_labels, _) in zip(batches, loader):
        m = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
        s = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
        reference = (raw.double() / 255 - m) / s
        assert images.dtype == torch.float32 and skipped == 0
        torch.testing.assert_close(images.double(), reference, rtol=0, atol=1e-6)
        assert torch.equal(labels, raw_labels)
        count += len(labels)
    assert count == 20
    images, _, _ = next(iter(DeviceBatches(loader, "cpu", mean, std, channels_last=True)))
    assert images.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_batches_cuda_matches_cpu():
    base = Synthetic(40, 16, 5, seed=0)
    dataset = AugmentedDataset(base, functools.partial(build_transform, "none"), train=False)
    loader = _loader(dataset, 2, image_size=16, shuffle=False, pin_memory=True)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    on_cpu = list(DeviceBatches(loader, "cpu", mean, std))
    on_gpu = list(DeviceBatches(loader, "cuda", mean, std, channels_last=True))
    assert len(on_gpu) == len(on_cpu) == 5
    for (xg, yg, sg), (xc, yc, sc) in zip(on_gpu, on_cpu):
        assert xg.is_cuda and yg.is_cuda and sg == sc
        torch.testing.assert_close(xg.cpu(), xc, rtol=0, atol=1e-6)
        assert torch.equal(yg.cpu(), yc)
