"""Data loading with exact, resumable randomness.

The sampler runs in the main process and hands every sample a key ``(index, seed, image_size)``.
The worker that loads the sample augments it under an RNG seeded with that seed. Hence:

- the augmentation of sample i in epoch e depends only on (seed, e, i): not on the number of
  workers, on persistent workers, or on what ran before, so a run resumed at epoch e reproduces
  the uninterrupted run exactly;
- the image size can change between epochs (a size curriculum) even with persistent workers,
  because it travels in the key instead of living in worker state.

Batches stay uint8 up to the device, where ``DeviceBatches`` converts and normalises them.
"""

import atexit
import copy
import functools
import hashlib
import itertools
import logging
import math
import multiprocessing
import multiprocessing.util  # noqa: F401  (imported before the at-exit kill is registered: see below)
import signal
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from pycls import distributed as dist
from pycls import signals
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.loading import epoch_orders
from pycls.datasets.loading.corrupt_samples import (
    Skipped,
    kept_and_skipped,
    load_or_skip,
    skipped_or_raised,
)
from pycls.datasets.loading.dead_workers import (
    WORKER_DIED,
    dead_worker,
    shut_down_workers,
    watch,
    worker_reports_absorbed,
)

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1

Key = tuple[int, int, int]  # (index, seed, image_size)


def _splitmix64(x: int) -> int:
    # A standard 64-bit integer hash (splitmix64 finaliser): nearby inputs give unrelated outputs,
    # so consecutive indices and epochs get independent augmentation streams.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of one sample: a 63-bit hash of (seed, epoch, index)."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (epoch & _MASK64))
    h = _splitmix64(h ^ (index & _MASK64))
    return h >> 1  # 63 bits: a valid seed for torch.manual_seed and a non-negative int64


class SeededSampler(Sampler[Key]):
    """Yields this rank's keys ``(index, seed, image_size)`` for one epoch.

    The order is a permutation drawn from a hash of (seed, epoch) (identity when not shuffling;
    a hash, not ``seed + epoch``, so that seed s at epoch e + 1 does not repeat seed s + 1 at
    epoch e), sharded like ``DistributedSampler``: without ``drop_last`` the permutation is padded
    by wrapping around to a multiple of ``world_size`` (so a few samples repeat), with it the tail
    is dropped. ``set_epoch(epoch, skip=n)`` starts the epoch after this rank's first n keys (a
    run resumed mid-epoch does not load again what it trained before the stop); ``len`` stays
    the whole epoch's.

    ``order`` draws the epoch's order (``pycls.datasets.loading.epoch_orders``): "global" (one
    permutation of every sample), "shards" (the shards permuted, their samples streamed through
    a seeded buffer of ``shuffle_buffer``; needs ``shard_sizes``) or "resampled" (shards drawn
    with replacement, as many samples as the data set holds). ``grain`` deals the order to the
    ranks in runs of that many consecutive samples (a per-process batch, so that one batch reads
    one stretch of a shard) instead of one at a time. Whatever the order and grain, the samples
    of the first k steps of all ranks together are the first k x (global batch) samples of the
    order, so a resume on another number of processes continues with exactly the samples not yet
    seen.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool,
        seed: int,
        image_size: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        repeats: int = 1,
        order: str = "global",
        shard_sizes: Sequence[int] | None = None,
        shuffle_buffer: int = 0,
        grain: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if repeats < 1 or grain < 1:
            raise ValueError(f"repeats and grain must be >= 1, got {repeats} and {grain}")
        epoch_orders.check(order, num_samples, shard_sizes, repeats)
        self.order, self.shuffle_buffer, self.grain = order, shuffle_buffer, grain
        self.shard_sizes = list(shard_sizes) if shard_sizes is not None else None
        self.repeats = repeats
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.image_size = image_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self.epoch, self.skip = epoch, skip

    def set_image_size(self, image_size: int) -> None:
        self.image_size = image_size

    def order_settings(self) -> str:
        """What draws the epoch's order besides the seed and the sample count, as a checkpoint
        records it: "global", or the shard-wise order, its buffer and the shards' lengths."""
        if self.order == "global":
            return "global"
        lengths = ",".join(map(str, self.shard_sizes)).encode()
        digest = hashlib.sha256(lengths).hexdigest()[:12]
        return (
            f"{self.order}, buffer {self.shuffle_buffer}, {len(self.shard_sizes)} shards {digest}"
        )

    def _total(self) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        unit = self.world_size * self.grain
        return rounding(self.num_samples / unit) * unit

    def __len__(self) -> int:
        return self._total() // self.world_size

    def _positions(self) -> range | list[int]:
        """This rank's positions in the epoch's order: runs of ``grain`` dealt in turn."""
        total, world, grain = self._total(), self.world_size, self.grain
        if grain == 1:
            return range(self.rank, total, world)
        runs = range(self.rank * grain, total, world * grain)
        return [start + i for start in runs for i in range(grain)]

    def num_unpadded(self) -> int:
        """How many of this rank's keys are not padding. The padding comes last in every rank's
        stream, so an evaluation counts the first num_unpadded() samples and drops the rest:
        every sample then counts exactly once, whatever the number of processes."""
        real = self.num_samples * self.repeats
        if self.grain == 1:
            return min(len(self), max(0, -(-(real - self.rank) // self.world_size)))
        return sum(1 for p in self._positions() if p < real)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        if self.order != "global":
            return epoch_orders.shard_order(
                self.shard_sizes,
                sample_seed(self.seed, self.epoch, -1),
                buffer=self.shuffle_buffer,
                resampled=self.order == "resampled",
            )
        generator = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, -1))
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[Key]:
        # Read once: a size set mid-epoch applies from the next epoch, never to half of one.
        epoch, image_size, total, skip = self.epoch, self.image_size, self._total(), self.skip
        # Repeated augmentation (DeiT): each index k times in a row, so that with several ranks the
        # copies go to different ranks; the epoch keeps its length. A copy's seed takes its repeat
        # number, so every copy is augmented differently.
        order = [(i, r) for i in self._order() for r in range(self.repeats)]
        if total > len(order) and order:
            order = (order * math.ceil(total / len(order)))[:total]
        # Resampled shards hold a sample more than once: its seed is its place in the epoch
        by_place = self.shuffle and self.order == "resampled"
        for p in self._positions()[skip:]:
            index, r = order[p]
            which = p if by_place else index + r * self.num_samples
            yield index, sample_seed(self.seed, epoch, which), image_size


class AugmentedDataset(Dataset):
    """Applies ``transform_factory(image_size, train)`` to ``base`` samples addressed by keys.

    ``transform_factory`` is e.g. ``functools.partial(build_transform, "imagenet")``; one
    transform is built and cached per image size. With ``skip_corrupt``, a sample whose image
    raises ``CorruptImageError`` comes back as ``Skipped`` (dropped, counted and named by the
    collate).
    """

    def __init__(
        self,
        base: Dataset,
        transform_factory: Callable[[int, bool], Callable[[torch.Tensor], torch.Tensor]],
        train: bool,
        *,
        skip_corrupt: bool = False,
    ):
        self.base = base
        self.transform_factory = transform_factory
        self.train = train
        self.skip_corrupt = skip_corrupt
        self._transforms: dict[int, Callable] = {}

    def __len__(self) -> int:
        return len(self.base)

    def _transform(self, image_size: int) -> Callable:
        if image_size not in self._transforms:
            self._transforms[image_size] = self.transform_factory(image_size, self.train)
        return self._transforms[image_size]

    def __getitem__(self, key: Key) -> tuple[torch.Tensor, int] | None:
        index, seed, image_size = key
        loaded = load_or_skip(self.base, index, self.skip_corrupt)
        return loaded if isinstance(loaded, Skipped) else self._augment(*loaded, seed, image_size)

    def __getitems__(self, keys: Sequence[Key]) -> list:
        """A batch of samples (the DataLoader's batched fetch): a base with ``load_many`` reads
        the batch's bytes in one go (concurrent byte ranges from a URL), the same samples as
        ``__getitem__`` one by one."""
        load_many = getattr(self.base, "load_many", None)
        # A subclass that loads samples its own way (on-device augmentation) keeps its way
        if load_many is None or type(self).__getitem__ is not AugmentedDataset.__getitem__:
            return [self[key] for key in keys]
        out = []
        for (_, seed, image_size), loaded in zip(keys, load_many([k[0] for k in keys])):
            if isinstance(loaded, CorruptImageError):
                out.append(skipped_or_raised(loaded, self.skip_corrupt))
            else:
                out.append(self._augment(*loaded, seed, image_size))
        return out

    def _augment(self, image, label, seed, image_size):
        transform = self._transform(image_size)
        # fork_rng restores the global CPU RNG afterwards: with num_workers=0 this runs in the
        # main process, whose RNG (dropout, mixing, ...) must not depend on data loading. Only
        # the CPU generator is seeded (the transforms draw from it): torch.manual_seed would also
        # reseed every CUDA device's generator, and before CUDA is initialised it queues that as a
        # lazy call that captures a stack trace, ~4 ms per sample.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            image = transform(image)
        return image, label


def collate_skipping(
    batch: Sequence[tuple[torch.Tensor, int] | Skipped | None],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stack samples into ``(uint8 (B, 3, S, S), int64 (B,), num_skipped)``, dropping skipped
    samples (``Skipped`` or None); ``num_skipped`` is a ``SkipCount`` naming them.

    Always a 3-tuple so the trainer has one batch shape to handle. A batch whose samples were all
    skipped has B = 0 and images of shape (0, 3, 0, 0).
    """
    samples, num_skipped = kept_and_skipped(batch)
    if not samples:
        return (
            torch.empty(0, 3, 0, 0, dtype=torch.uint8),
            torch.empty(0, dtype=torch.int64),
            num_skipped,
        )
    images = torch.stack([image for image, _ in samples])
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    return images, labels, num_skipped


def ignore_stop_signals(worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: SIGTERM and SIGUSR1 are for the main process.

    SLURM signals every process of a job step on preemption or ``scancel --signal``, loader
    workers included, and torch's workers die of SIGTERM. The main process decides when to stop
    (it checkpoints first) and then shuts its workers down itself.
    """
    for sig in signals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # A terminal's Ctrl-C reaches the workers too: the main process stops (or aborts) the run
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@functools.cache
def _stop_flag():
    """The flag in shared memory through which this process's stop reaches its loader workers
    (made before any of them starts, passed to each: fork, spawn and forkserver alike)."""
    flag = multiprocessing.RawValue("i", 0)
    signals.share_stops(flag)
    return flag


def _start_worker(flag, worker_id: int) -> None:
    ignore_stop_signals(worker_id)
    signals.follow_stops(flag)


def worker_init_fn() -> Callable[[int], None]:
    """A loader worker's ``worker_init_fn``: it ignores the stop signals (``ignore_stop_signals``)
    but follows its main process's stop, so that a read it is stuck in ends within seconds of the
    stop (pycls.signals) and the main process, waiting for that batch, can stop."""
    return functools.partial(_start_worker, _stop_flag())


def _kill_workers_at_exit() -> None:
    """At exit, multiprocessing ends its daemonic children with SIGTERM and then waits for them.
    Loader workers ignore SIGTERM, so when an iterator is still alive then (its frame kept by the
    traceback of an error, say) that wait would never end: they are killed first."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()


@functools.cache
def _kill_workers_at_exit_once() -> None:
    # atexit runs the last registered first: this after multiprocessing's handler, so before it
    atexit.register(_kill_workers_at_exit)


def _stop_pending() -> bool:
    return dist.stop_pending()


def loader_batches(loader: DataLoader) -> Iterator:
    """Iterates ``loader``; a worker that dies while this process is stopping (signalled, its
    checkpoint not yet written) does not end the epoch early: the remaining batches are loaded
    here, in the main process, exactly as the workers would have (each sample's augmentation
    depends on its key only), until the trainer reaches its stop."""
    batches, done = iter(loader), 0
    if loader.num_workers:
        watch(batches)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except WORKER_DIED as e:
            if loader.num_workers == 0 or not _stop_pending():
                died = dead_worker(batches, e) if loader.num_workers else None
                with worker_reports_absorbed():
                    shut_down_workers(loader, batches)
                if died is not None:
                    raise died from None
                raise
            logger.warning(f"loading in the main process until the stop: {e}")
            break
        except Exception:
            shut_down_workers(loader, batches)
            raise
        done += 1
        yield batch
    del batches  # shuts the remaining workers down
    keys = BatchSampler(loader.sampler, loader.batch_size, loader.drop_last)
    for batch_keys in itertools.islice(keys, done, None):
        yield loader.collate_fn([loader.dataset[key] for key in batch_keys])


def construct_loader(
    dataset: AugmentedDataset,
    *,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    num_workers: int,
    pin_memory: bool,
    persistent_workers: bool,
    prefetch_factor: int,
    seed: int,
    image_size: int,
    rank: int = 0,
    world_size: int = 1,
    skip_corrupt: bool = False,
    repeats: int = 1,
    order: str = "global",
    shuffle_buffer: int = 0,
) -> DataLoader:
    """A DataLoader of ``(images uint8, labels int64, num_skipped)`` over this rank's shard.

    Its ``sampler`` attribute is the ``SeededSampler``: call ``loader.sampler.set_epoch(e)``
    before each epoch (and ``set_image_size(s)`` to change the size). ``drop_last`` applies to
    both the shard (no padding) and the final incomplete batch. ``order`` "shards" or
    "resampled" (the data set's ``shard_sizes`` give its shards) deals each process whole
    batches of consecutive samples of the order, so that a batch reads one stretch of a shard.
    """
    if not isinstance(dataset, AugmentedDataset):
        # Fail here rather than deep in a worker: the sampler yields keys, not indices.
        raise TypeError(
            "construct_loader needs an AugmentedDataset (its sampler yields (index, seed, "
            f"image_size) keys), got {type(dataset).__name__}"
        )
    if skip_corrupt != dataset.skip_corrupt:
        # A shallow copy, so the caller's dataset keeps its own policy.
        dataset = copy.copy(dataset)
        dataset.skip_corrupt = skip_corrupt
    sampler = SeededSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        image_size=image_size,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        repeats=repeats,
        order=order,
        shard_sizes=getattr(dataset.base, "shard_sizes", None) if order != "global" else None,
        shuffle_buffer=shuffle_buffer,
        # Copies of a repeated sample must reach different ranks: one at a time then
        grain=batch_size if order != "global" and repeats == 1 else 1,
    )
    workers = num_workers > 0
    if workers:
        _kill_workers_at_exit_once()
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=collate_skipping,
        # Pinning needs a CUDA device; without one torch would only warn and do nothing.
        pin_memory=pin_memory and torch.cuda.is_available(),
        # Both options are only valid with worker processes.
        persistent_workers=persistent_workers and workers,
        prefetch_factor=prefetch_factor if workers else None,
        worker_init_fn=worker_init_fn() if workers else None,
        # A private generator: the DataLoader draws a base seed from it at every epoch, which
        # would otherwise advance the main process's global RNG.
        generator=torch.Generator().manual_seed(seed),
    )


class DeviceBatches:
    """Moves loader batches to ``device`` and normalises them there, as float32.

    ``mean`` and ``std`` are per channel in 0-1 units; images become (x - 255 mean) / (255 std).
    On CUDA the next batch is copied on a side stream while the current one is being used, so the
    copy overlaps compute. Nothing here waits on the device (no ``.item()``, no synchronize).
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | str,
        mean: Sequence[float],
        std: Sequence[float],
        channels_last: bool = False,
    ):
        self.loader = loader
        self.device = torch.device(device)
        # Scaled in float64, then rounded once to float32.
        scale = torch.tensor(255.0, dtype=torch.float64)
        self.mean = (torch.tensor(mean, dtype=torch.float64) * scale).float().view(1, -1, 1, 1)
        self.std = (torch.tensor(std, dtype=torch.float64) * scale).float().view(1, -1, 1, 1)
        self.mean = self.mean.to(self.device)
        self.std = self.std.to(self.device)
        self.channels_last = channels_last

    def __len__(self) -> int:
        return len(self.loader)

    def _to_device(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor, int]:
        images, labels, num_skipped = batch
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        images = images.float().sub_(self.mean).div_(self.std)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels, num_skipped

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        if self.device.type != "cuda":
            for batch in loader_batches(self.loader):
                yield self._to_device(batch)
            return
        yield from self._prefetched()

    def _prefetched(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        side = torch.cuda.Stream(self.device)
        batches = loader_batches(self.loader)

        def load_next():
            batch = next(batches, None)
            if batch is None:
                return None
            with torch.cuda.stream(side):
                return self._to_device(batch)

        ready = load_next()
        while ready is not None:
            main = torch.cuda.current_stream(self.device)
            # Wait for this batch's copy only: the next one is queued on `side` after this point.
            main.wait_stream(side)
            images, labels, num_skipped = ready
            # Allocated on `side` but used on `main`: keep the memory from being reused by `side`
            # until `main` has finished with it.
            images.record_stream(main)
            labels.record_stream(main)
            ready = load_next()
            yield images, labels, num_skipped
