"""Batches with a token budget: images of several patch grids, padded or packed into sequences.

The sampler (``TokenBudgetSampler``) plans each epoch in the main process, from (seed, epoch)
alone: for every optimizer step it draws the batch's grid cap (one of the sizes, the same on every
process), then fills each process's micro-batches image by image, each image with a grid (h, w)
of its own under the cap (an aspect ratio and an area drawn from its sample seed). A padded
micro-batch holds budget / cap images, each in a sequence of its own; a packed one fills budget /
cap sequences first-fit with as many images as fit. The tokens per micro-batch are therefore
fixed (a few sequence shapes, one per cap: compiled blocks see no new shape per batch), the images
per micro-batch are not. Every process plans the whole epoch, so all run the same number of steps
(no process waits in a collective its peers never reach), and a resumed run skips the micro-batches
it trained (``set_epoch(epoch, skip)``) and continues exactly. The epoch's number of steps is that
of epoch 0 (each epoch stops there, wrapping to the start of its order if it runs short).

The dataset (``TokenBudgetDataset``) loads a planned micro-batch in one worker: each image
augmented as its square preset at the longer side and resized to its grid, then collated into a
``pycls.models.vit.token_masks.TokenBatch`` (the index tensors the model gathers with). On the
device, ``TokenDeviceBatches`` normalises the canvas and ``TokenBatchMixer`` mixes each image with
its neighbour (mixup / cutmix), before the model packs anything.
"""

import copy
import math
import random
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms.v2 import functional as TF

from pycls.datasets.loading.corrupt_samples import is_skipped, kept_and_skipped
from pycls.datasets.loading.loader import (
    AugmentedDataset,
    DeviceBatches,
    _kill_workers_at_exit_once,
    _splitmix64,
    sample_seed,
    worker_init_fn,
)
from pycls.datasets.loading.transforms import BatchMixer
from pycls.models.vit.token_masks import TokenBatch

_UNIT = 1.0 / (1 << 53)


def _uniforms(seed: int) -> tuple[float, float]:
    """Two independent uniforms in [0, 1) from a sample's seed (its grid's aspect and area)."""
    a = _splitmix64(seed)
    b = _splitmix64(seed ^ 0x5DEECE66D)
    return (a >> 11) * _UNIT, (b >> 11) * _UNIT


def draw_grid(cap: int, u_aspect: float, u_area: float, max_aspect: float, min_scale: float):
    """The (h, w) patch grid of an image under a cap of ``cap`` patches: its area uniform in
    [min_scale, 1] x cap, its aspect ratio h / w log-uniform in [1 / max_aspect, max_aspect];
    h * w <= cap always. With max_aspect 1 and min_scale 1 a square cap gives the square grid."""
    area = cap * (min_scale + (1.0 - min_scale) * u_area)
    aspect = max_aspect ** (2.0 * u_aspect - 1.0)
    h = max(1, int(math.sqrt(area * aspect)))
    w = max(1, int(area / h))
    return h, w


class MicroBatchPlan(NamedTuple):
    """One micro-batch: ``keys`` (index, seed, (h, w)) per image, the sequence each image goes
    in, and the sequences' shape (their count, positions each, prefix tokens included)."""

    keys: tuple
    sequences: tuple
    num_sequences: int
    sequence_length: int


class TokenBudgetSampler(Sampler[MicroBatchPlan]):
    """This process's micro-batches of an epoch, under a budget of patch tokens per micro-batch.

    Args: ``num_samples`` of the data set; ``seed``; ``patch_size``; ``sizes`` the caps in pixels
    (square sides, multiples of the patch; one drawn per optimizer step); ``budget`` patch tokens
    per micro-batch of one process (at least the largest cap's); ``max_aspect`` (>= 1) and
    ``min_scale`` (in (0, 1]) of the images' grids (``draw_grid``); ``pack``: several images per
    sequence; ``num_prefix``: the model's class and register tokens (each image has its own);
    ``rank``, ``world_size``, ``accum`` (micro-batches per step), ``repeats`` (repeated
    augmentation, as ``SeededSampler``), ``shuffle``.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int,
        patch_size: int,
        sizes: Sequence[int],
        budget: int,
        max_aspect: float = 1.0,
        min_scale: float = 1.0,
        pack: bool = False,
        num_prefix: int = 0,
        rank: int = 0,
        world_size: int = 1,
        accum: int = 1,
        repeats: int = 1,
        shuffle: bool = True,
    ):
        if not sizes or any(s <= 0 or s % patch_size for s in sizes):
            raise ValueError(f"sizes must be positive multiples of {patch_size}, got {sizes}")
        self.caps = sorted({(s // patch_size) ** 2 for s in sizes})
        if budget < self.caps[-1]:
            raise ValueError(
                f"a budget of {budget} patch tokens per micro-batch holds no image of the largest "
                f"size {max(sizes)} px ({self.caps[-1]} patches)"
            )
        if max_aspect < 1 or not 0 < min_scale <= 1:
            raise ValueError(
                f"max_aspect must be >= 1 and min_scale in (0, 1], got {max_aspect}, {min_scale}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.num_samples, self.seed, self.patch_size = num_samples, seed, patch_size
        self.budget, self.max_aspect, self.min_scale = budget, max_aspect, min_scale
        self.pack, self.num_prefix = pack, num_prefix
        self.rank, self.world_size, self.accum = rank, world_size, accum
        self.repeats, self.shuffle = repeats, shuffle
        self.image_size = max(sizes)  # the largest side an image of an epoch can have
        self.epoch, self.skip = 0, 0
        self._steps = None
        first = self._plan(0)
        self._steps = len(first) // accum  # every epoch has epoch 0's number of steps
        self._cached = (0, first)

    # -- the trainer's interface (as SeededSampler's) ---------------------------------------- #
    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Starts ``epoch`` after this process's first ``skip`` micro-batches."""
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self.epoch, self.skip = epoch, skip

    def set_image_size(self, image_size: int) -> None:
        """The sizes come from the plan; a fixed training size changes nothing."""

    def order_settings(self) -> str:
        """What a checkpoint's position records of the order (as SeededSampler's): the epoch is
        the plan's, whose settings ``signature`` gives (the trainer checks them on resuming)."""
        return "token plan"

    def __len__(self) -> int:
        return self._steps * self.accum

    def __iter__(self) -> Iterator[MicroBatchPlan]:
        yield from self.plan(self.epoch)[self.skip :]

    @property
    def steps_per_epoch(self) -> int:
        return self._steps

    def signature(self) -> dict:
        """What draws the plan besides seed and epoch: a resumed epoch must have the same."""
        return {
            "budget": self.budget,
            "caps": list(self.caps),
            "max_aspect": self.max_aspect,
            "min_scale": self.min_scale,
            "pack": self.pack,
            "num_prefix": self.num_prefix,
            "world_size": self.world_size,
            "accum": self.accum,
        }

    # -- the plan ------------------------------------------------------------------------------ #
    def plan(self, epoch: int) -> list[MicroBatchPlan]:
        """This process's micro-batches of ``epoch``, in order (cached for the last epoch asked)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self._plan(epoch))
        return self._cached[1]

    def _order(self, epoch: int) -> list[tuple[int, int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(sample_seed(self.seed, epoch, -1))
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        return [(i, r) for i in order for r in range(self.repeats)]

    def _plan(self, epoch: int) -> list[MicroBatchPlan]:
        order = self._order(epoch)
        caps = random.Random(sample_seed(self.seed, epoch, -2))
        wrap = self._steps is not None
        mine, cursor, step = [], [0], 0
        while self._steps is None or step < self._steps:
            cap = caps.choice(self.caps)  # the same draw in every process
            plans = []
            for _ in range(self.accum):
                for rank in range(self.world_size):
                    plan = self._fill(order, cursor, cap, epoch, wrap)
                    if plan is None:  # epoch 0 ran out of images: its last step is incomplete
                        return mine
                    if rank == self.rank:
                        plans.append(plan)
            mine.extend(plans)
            step += 1
        return mine

    def _next(self, order, cursor, epoch, wrap, cap):
        """The key of the image at ``cursor`` (None when the order is used up and not wrapping)."""
        if not order or (cursor[0] >= len(order) and not wrap):
            return None
        index, repeat = order[cursor[0] % len(order)]
        seed = sample_seed(self.seed, epoch, index + repeat * self.num_samples)
        u_aspect, u_area = _uniforms(seed)
        return index, seed, draw_grid(cap, u_aspect, u_area, self.max_aspect, self.min_scale)

    def _fill(self, order, cursor, cap, epoch, wrap):
        slots, length = self.budget // cap, cap + self.num_prefix
        keys, sequences = [], []
        if not self.pack:
            for slot in range(slots):
                key = self._next(order, cursor, epoch, wrap, cap)
                if key is None:
                    return None
                cursor[0] += 1
                keys.append(key)
                sequences.append(slot)
            return MicroBatchPlan(tuple(keys), tuple(sequences), slots, length)
        # First fit over the open sequences. A sequence closes once no image could fit in it:
        # an image of area A >= min_scale * cap has h * w >= A - h >= A - sqrt(cap * max_aspect)
        least = int(self.min_scale * cap - math.sqrt(cap * self.max_aspect))
        smallest = self.num_prefix + max(1, least)
        open_free, opened = [], 0  # [sequence, free positions]
        while True:
            key = self._next(order, cursor, epoch, wrap, cap)
            if key is None:
                return None
            h, w = key[2]
            need = self.num_prefix + h * w
            spot = next((s for s in open_free if s[1] >= need), None)
            if spot is None:
                if opened == slots:
                    break  # this image starts the next micro-batch
                spot = [opened, length]
                open_free.append(spot)
                opened += 1
            cursor[0] += 1
            keys.append(key)
            sequences.append(spot[0])
            spot[1] -= need
            if spot[1] < smallest:
                open_free.remove(spot)
        return MicroBatchPlan(tuple(keys), tuple(sequences), slots, length)


# ------------------------------------------------------------------------------------------------ #
# Loading and collating a planned micro-batch
# ------------------------------------------------------------------------------------------------ #


def collate_token_batch(
    samples, plan: MicroBatchPlan, patch_size: int, num_prefix: int, pack: bool
):
    """``(TokenBatch, labels, num_skipped)`` of a planned micro-batch's samples (``(image uint8
    (C, h p, w p), label)``, or Skipped / None for a corrupt one): images on a canvas, and the
    index tensors of ``TokenBatch``. A micro-batch whose images were all skipped is the empty
    batch ``collate_skipping`` gives, (0, 3, 0, 0) images."""
    p = patch_size
    loaded, num_skipped = kept_and_skipped(samples)
    kept = list(zip(loaded, [q for s, q in zip(samples, plan.sequences) if not is_skipped(s)]))
    if not kept:
        empty = torch.empty(0, 3, 0, 0, dtype=torch.uint8)
        return empty, torch.empty(0, dtype=torch.int64), num_skipped
    images = [image for (image, _), _ in kept]
    labels = torch.tensor([label for (_, label), _ in kept], dtype=torch.int64)
    grids = [(image.shape[-2] // p, image.shape[-1] // p) for image in images]
    n, rows, cols = len(images), max(g[0] for g in grids), max(g[1] for g in grids)
    canvas = torch.zeros(n, images[0].shape[0], rows * p, cols * p, dtype=images[0].dtype)
    for i, image in enumerate(images):
        canvas[i, :, : image.shape[-2], : image.shape[-1]] = image
    pos_grids = tuple(sorted(set(grids)))
    offsets, offset = {}, num_prefix
    for g in pos_grids:
        offsets[g], offset = offset, offset + g[0] * g[1]
    s, length = plan.num_sequences, plan.sequence_length
    token_index = torch.zeros(s, length, dtype=torch.int64)
    pos_index = torch.zeros(s, length, dtype=torch.int64)
    segments = torch.full((s, length), -1, dtype=torch.int64)
    prefix = torch.arange(num_prefix)
    fill = [0] * s
    pool_index, pool_image, first_token = [], [], []
    for i, ((h, w), (_, seq)) in enumerate(zip(grids, kept)):
        start, count = fill[seq], num_prefix + h * w
        if start + count > length:
            raise ValueError(f"an image of {h}x{w} patches does not fit its sequence")
        patch = (torch.arange(h)[:, None] * cols + torch.arange(w)[None, :]).flatten()
        token_index[seq, start : start + count] = torch.cat(
            [prefix, num_prefix + i * rows * cols + patch]
        )
        pos_index[seq, start : start + count] = torch.cat(
            [prefix, offsets[(h, w)] + torch.arange(h * w)]
        )
        segments[seq, start : start + count] = i
        first_token.append(seq * length + start)
        pool_index.append(seq * length + start + num_prefix + torch.arange(h * w))
        pool_image.append(torch.full((h * w,), i, dtype=torch.int64))
        fill[seq] += count
    batch = TokenBatch(
        canvas=canvas,
        token_index=token_index,
        pos_index=pos_index,
        segments=segments,
        pool_index=torch.cat(pool_index),
        pool_image=torch.cat(pool_image),
        pool_count=torch.tensor([float(h * w) for h, w in grids]),
        first_token=torch.tensor(first_token, dtype=torch.int64),
        image_grids=tuple(grids),
        pos_grids=pos_grids,
        packed=pack,
        counts=(sum(fill), s * length),
    )
    return batch, labels, num_skipped


class TokenBudgetDataset(Dataset):
    """An AugmentedDataset addressed by whole planned micro-batches: ``dataset[plan]`` loads and
    collates one (in a loader worker). Each image is augmented as the square preset at its
    grid's longer side (the same per-sample seed as any sample) and resized to its grid."""

    def __init__(
        self, augmented: AugmentedDataset, *, patch_size: int, num_prefix: int, pack: bool
    ):
        self.augmented = augmented
        self.patch_size, self.num_prefix, self.pack = patch_size, num_prefix, pack

    def __len__(self) -> int:
        return len(self.augmented)

    def _load(self, key):
        index, seed, (h, w) = key
        p = self.patch_size
        sample = self.augmented[(index, seed, max(h, w) * p)]
        if is_skipped(sample):
            return sample
        image, label = sample
        if tuple(image.shape[-2:]) != (h * p, w * p):
            image = TF.resize(image, [h * p, w * p], antialias=True)
        return image, label

    def __getitem__(self, plan: MicroBatchPlan):
        samples = [self._load(key) for key in plan.keys]
        return collate_token_batch(samples, plan, self.patch_size, self.num_prefix, self.pack)


def _the_batch(items):
    """A loader 'batch' of one planned micro-batch: the batch the dataset collated."""
    return items[0]


def construct_token_loader(
    dataset: TokenBudgetDataset,
    sampler: TokenBudgetSampler,
    *,
    num_workers: int,
    pin_memory: bool,
    persistent_workers: bool,
    prefetch_factor: int,
    seed: int,
    skip_corrupt: bool = False,
) -> DataLoader:
    """A DataLoader of ``(TokenBatch, labels, num_skipped)``, one planned micro-batch at a time
    (its ``sampler`` is the TokenBudgetSampler, its ``batch_size`` 1: one plan per batch)."""
    if skip_corrupt != dataset.augmented.skip_corrupt:
        dataset = copy.copy(dataset)
        dataset.augmented = copy.copy(dataset.augmented)
        dataset.augmented.skip_corrupt = skip_corrupt
    workers = num_workers > 0
    if workers:
        _kill_workers_at_exit_once()
    return DataLoader(
        dataset,
        batch_size=1,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=_the_batch,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=persistent_workers and workers,
        prefetch_factor=prefetch_factor if workers else None,
        worker_init_fn=worker_init_fn() if workers else None,
        generator=torch.Generator().manual_seed(seed),
    )


class TokenDeviceBatches(DeviceBatches):
    """DeviceBatches for token batches: every tensor to the device, the canvas normalised there
    (plain image batches, e.g. an all-skipped one, as DeviceBatches does)."""

    def _to_device(self, batch):
        images, labels, num_skipped = batch
        if not isinstance(images, TokenBatch):
            return super()._to_device(batch)
        images = images.to(self.device, non_blocking=True)
        canvas = images.canvas.float().sub_(self.mean).div_(self.std)
        labels = labels.to(self.device, non_blocking=True)
        return images._replace(canvas=canvas), labels, num_skipped


# ------------------------------------------------------------------------------------------------ #
# Mixup / CutMix per image, before the model packs anything
# ------------------------------------------------------------------------------------------------ #


class TokenBatchMixer(BatchMixer):
    """BatchMixer that also mixes token batches: image i with image i - 1 (the batch rolled by
    one, as torchvision's MixUp and CutMix), the partner resized to image i's own size first; a
    CutMix box has the same relative place in every image, and each image's target weight is its
    own box's area. On a batch whose images share one size this is exactly BatchMixer."""

    def __init__(self, num_classes, *, patch_size, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.num_classes, self.patch_size = num_classes, patch_size

    def __call__(self, images, labels):
        if not isinstance(images, TokenBatch):
            return super().__call__(images, labels)
        if torch.rand(()) >= self.prob:
            return images, labels
        use_cutmix = self.mixup is None or (
            self.cutmix is not None and torch.rand(()) < self.switch_prob
        )
        if use_cutmix:
            return self._cutmix(images, labels)
        return self._mixup(images, labels)

    def _partners(self, batch):
        """Each image's partner (the one before it, the last for the first), resized to its size."""
        canvas, p = batch.canvas, self.patch_size
        partners = canvas.roll(1, 0)
        grids = batch.image_grids
        for i, (h, w) in enumerate(grids):
            ph, pw = grids[i - 1]
            if (ph, pw) != (h, w):
                source = canvas[i - 1, :, : ph * p, : pw * p].unsqueeze(0)
                partners[i, :, : h * p, : w * p] = F.interpolate(
                    source, size=(h * p, w * p), mode="bilinear", antialias=True
                )[0]
        return partners

    def _targets(self, labels, lam):
        target = F.one_hot(labels, self.num_classes).float()
        lam = torch.as_tensor(lam, dtype=target.dtype, device=target.device).reshape(-1, 1)
        return target.roll(1, 0).mul_(1.0 - lam).add_(target.mul(lam))

    def _mixup(self, batch, labels):
        lam = float(self.mixup._dist.sample(()))
        canvas = self._partners(batch).mul_(1.0 - lam).add_(batch.canvas.mul(lam))
        return batch._replace(canvas=canvas), self._targets(labels, lam)

    def _cutmix(self, batch, labels):
        lam = float(self.cutmix._dist.sample(()))
        canvas, p = batch.canvas, self.patch_size
        height, width = canvas.shape[-2:]
        r_x = int(torch.randint(width, size=(1,)))
        r_y = int(torch.randint(height, size=(1,)))
        r = 0.5 * math.sqrt(1.0 - lam)
        partners, out, lams = self._partners(batch), canvas.clone(), []
        for i, (h, w) in enumerate(batch.image_grids):
            hi, wi = h * p, w * p  # the box relative to the image as to the canvas
            cx, cy = r_x * wi // width, r_y * hi // height
            x1, y1 = max(cx - int(r * wi), 0), max(cy - int(r * hi), 0)
            x2, y2 = min(cx + int(r * wi), wi), min(cy + int(r * hi), hi)
            out[i, :, y1:y2, x1:x2] = partners[i, :, y1:y2, x1:x2]
            lams.append(1.0 - (x2 - x1) * (y2 - y1) / (wi * hi))
        return batch._replace(canvas=out), self._targets(labels, lams)


# ------------------------------------------------------------------------------------------------ #
# A stand-in batch (--mode time)
# ------------------------------------------------------------------------------------------------ #


def synthetic_token_batch(
    sampler: TokenBudgetSampler, num_classes: int, *, channels: int = 3, seed: int = 0
):
    """``(TokenBatch, labels)`` of random images along the first micro-batch the sampler plans
    (uint8 canvas: normalise it as the device batches do), for timing the step training runs."""
    plan = sampler.plan(0)[0]
    generator = torch.Generator().manual_seed(seed)
    p = sampler.patch_size
    samples = [
        (
            torch.randint(0, 256, (channels, h * p, w * p), generator=generator, dtype=torch.uint8),
            int(torch.randint(num_classes, (1,), generator=generator)),
        )
        for _, _, (h, w) in plan.keys
    ]
    batch, labels, _ = collate_token_batch(samples, plan, p, sampler.num_prefix, sampler.pack)
    return batch, labels
