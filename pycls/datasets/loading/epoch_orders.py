"""The order of an epoch over sharded data: shards permuted, their samples streamed through a
bounded shuffle buffer, as WebDataset pipelines read object storage; or shards drawn with
replacement ("resampled").

The order is computed whole, from the seed and the shards' sample counts, in the process that
samples: every rank draws the same one, and a resumed run draws it again, so the samples not yet
seen are known exactly (``pycls.datasets.loading.loader.SeededSampler`` deals it to ranks and
workers). Only sample indices are shuffled here, never the data.
"""

from collections.abc import Sequence

import numpy as np

ORDERS = ("global", "shards", "resampled")


def check(order: str, num_samples: int, shard_sizes: Sequence[int] | None, repeats: int) -> None:
    """Raises ValueError when ``order`` cannot be drawn for these shards."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; expected one of {list(ORDERS)}")
    if order == "global":
        return
    if shard_sizes is None:
        raise ValueError(f"order {order!r} needs the shards' sample counts (shard_sizes)")
    if sum(shard_sizes) != num_samples or any(n < 0 for n in shard_sizes):
        raise ValueError(
            f"the shards' sample counts add up to {sum(shard_sizes)}, not {num_samples} samples"
        )


def buffer_shuffle(stream: np.ndarray, buffer: int, rng: np.random.Generator) -> np.ndarray:
    """``stream`` through a shuffle buffer of ``buffer`` samples, as WebDataset's ``shuffle``:
    the buffer is filled, then each incoming sample takes the place of one drawn at random,
    which goes out; what remains at the end goes out in random order. A sample leaves at most
    ``buffer`` places early; 0 or 1 leaves the stream as it is."""
    if buffer <= 1 or len(stream) <= 1:
        return stream.copy()
    items = stream.tolist()
    fill = min(buffer, len(items))
    pool = items[:fill]
    draws = rng.random(len(items)).tolist()
    out = []
    for x, u in zip(items[fill:], draws):
        k = int(u * fill)  # the pool stays full while samples come in
        out.append(pool[k])
        pool[k] = x
    tail = np.asarray(pool, dtype=stream.dtype)
    return np.concatenate([np.asarray(out, dtype=stream.dtype), rng.permutation(tail)])


def shard_order(
    shard_sizes: Sequence[int], seed: int, *, buffer: int, resampled: bool = False
) -> list[int]:
    """The sample indices of one epoch (samples numbered shard after shard): the shards in a
    seeded random order (or, ``resampled``, drawn with replacement until the epoch holds as many
    samples as the data set), then a shuffle buffer of ``buffer`` samples over that stream."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = int(sizes.sum())
    rng = np.random.default_rng(seed)
    if resampled:
        picked, count = [], 0
        while count < total:
            shard = int(rng.integers(len(sizes)))
            picked.append(shard)
            count += int(sizes[shard])
    else:
        picked = rng.permutation(len(sizes)).tolist()
    parts = [np.arange(starts[k], starts[k] + sizes[k]) for k in picked]
    stream = np.concatenate(parts)[:total] if parts else np.zeros(0, dtype=np.int64)
    return buffer_shuffle(stream, buffer, rng).tolist()
