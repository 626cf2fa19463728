"""Augmentation of whole batches on the training device, so that CPU workers only slice bytes.

Per sample, the loader worker draws the augmentation parameters from the sample's seed (a crop
box, a flip and a shift; a few microseconds of host work) and hands over the stored uint8 pixels
or JPEG bytes untouched. On the device, after the copy, the whole batch is decoded (JPEG) and
resampled at once. Along each axis, crop + resize + shift + flip of one sample is a linear map:
an (out x in) matrix of antialiased linear-interpolation weights. The batch becomes
``rows @ images @ cols^T``: two batched matrix products, whatever the crop sizes.

The weights are those of antialiased bilinear resizing (a triangle filter, widened by the shrink
factor when shrinking, cut at the crop box's edges and normalised), as torchvision uses for
tensors, so the output matches torchvision's crop-then-resize of the same box: within 1 grey
level of its uint8 result (it rounds an intermediate to uint8; we keep float), within 1e-3 of its
float result (float32 summation order; on GPUs that allow TF32 matrix products, within ~0.25).

The same code runs on the CPU (the fallback; what the CPU-only tests check): parameters come from
the seeds on the host in either case, so both devices crop the same boxes and flip the same
samples.
"""

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader

from pycls.datasets.formats.decode import decode_jpegs
from pycls.datasets.loading.corrupt_samples import Skipped, kept_and_skipped, load_or_skip
from pycls.datasets.loading.loader import (
    AugmentedDataset,
    DeviceBatches,
    Key,
    construct_loader,
)

# Presets of transforms.PRESETS that can run here. "digits" cannot: its small rotations do not
# separate into one map per axis.
DEVICE_PRESETS = ("imagenet", "cifar", "none")

# Candidate boxes a random resized crop tries before falling back to a centred box.
CROP_TRIES = 10

# Evaluation crop: the classic "resize to 256, centre-crop 224" protocol keeps the centre 87.5 %.
EVAL_CROP_FRACTION = 0.875

# One row of parameters per sample: the crop box (in source pixels), horizontal flip (0/1), and a
# shift of the output with reflection at the edges (the pad-and-crop of the cifar preset).
PARAM_NAMES = ("top", "left", "height", "width", "flip", "shift_y", "shift_x")


# ------------------------------------------------------------------------------------------------ #
# Parameters, drawn on the host from a per-sample generator
# ------------------------------------------------------------------------------------------------ #


def random_resized_crop_box(
    height: int,
    width: int,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> tuple[int, int, int, int]:
    """A random resized crop box ``(top, left, h, w)`` of a height x width image.

    The definition of the Inception / torchvision crop: up to ``CROP_TRIES`` candidates, each with
    an area drawn uniformly from ``scale`` times the image's and an aspect ratio w/h drawn
    uniformly in log space from ``ratio``; the first candidate that fits the image is placed at a
    uniformly random position. If none fits, the whole image cut to the nearest allowed aspect
    ratio, centred. Always draws the same number of values from ``generator``.
    """
    # All candidates' random numbers at once: one call instead of up to forty.
    draws = torch.rand(4, CROP_TRIES, generator=generator, dtype=torch.float64).tolist()
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for u_area, u_ratio, u_top, u_left in zip(*draws):
        area = height * width * (scale[0] + u_area * (scale[1] - scale[0]))
        aspect = math.exp(log_lo + u_ratio * (log_hi - log_lo))
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(height: int, width: int, fraction: float) -> tuple[int, int, int, int]:
    """The centred square whose side is ``fraction`` of the shorter side."""
    side = max(1, round(min(height, width) * fraction))
    return (height - side) // 2, (width - side) // 2, side, side


class DeviceAugment:
    """A preset of ``transforms.PRESETS`` (``DEVICE_PRESETS`` only) for whole batches.

    ``sample`` draws one sample's parameter row on the host; calling the object applies a batch of
    rows to a batch of images on their device. What each preset does:

    - imagenet: train, random resized crop (``scale``, ``ratio``) + horizontal flip; eval, the
      centred ``EVAL_CROP_FRACTION`` square, resized;
    - cifar: train, resize to the output size, shift by up to 1/8 of it with reflection (pad and
      crop) + horizontal flip; eval, resize only;
    - none: resize only.
    """

    def __init__(
        self,
        preset: str,
        train: bool,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
    ):
        if preset not in DEVICE_PRESETS:
            raise ValueError(
                f"preset {preset!r} does not run on the device; expected one of {DEVICE_PRESETS}"
            )
        self.preset, self.train = preset, train
        self.scale, self.ratio = tuple(scale), tuple(ratio)

    def sample(
        self, height: int, width: int, out_size: int, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """One sample's parameters (int64, ``PARAM_NAMES``) for an image of height x width."""
        box = (0, 0, height, width)
        if self.preset == "imagenet":
            if self.train:
                box = random_resized_crop_box(height, width, self.scale, self.ratio, generator)
            else:
                box = center_crop_box(height, width, EVAL_CROP_FRACTION)
        u_flip, u_y, u_x = torch.rand(3, generator=generator, dtype=torch.float64).tolist()
        random = self.train and self.preset != "none"
        flip = int(random and u_flip < 0.5)
        shift_y = shift_x = 0
        if random and self.preset == "cifar":
            pad = out_size // 8
            shift_y, shift_x = int(u_y * (2 * pad + 1)) - pad, int(u_x * (2 * pad + 1)) - pad
        return torch.tensor([*box, flip, shift_y, shift_x], dtype=torch.int64)

    def __call__(self, images: torch.Tensor, params: torch.Tensor, out_size: int) -> torch.Tensor:
        """Resample images (B, C, H, W), any dtype, by params (B, 7) on the same device.

        Returns float32 (B, C, out_size, out_size) in the input's units (0-255 for uint8).
        """
        batch, channels, height, width = images.shape
        top, left, h, w, flip, shift_y, shift_x = params.unbind(1)
        rows = _axis_weights(top, h, shift_y, height, out_size)
        cols = _axis_weights(left, w, shift_x, width, out_size)
        cols = torch.where(flip.bool()[:, None, None], cols.flip(1), cols)
        # Along x: every row of every channel, (B, C H, W) @ (B, W, out) -> (B, C H, out).
        x = torch.bmm(images.float().flatten(1, 2), cols.transpose(1, 2))
        x = x.view(batch, channels, height, out_size)
        # Along y: (B, 1, out, H) @ (B, C, H, out) -> (B, C, out, out).
        return torch.matmul(rows.unsqueeze(1), x)


def _axis_weights(
    start: torch.Tensor, length: torch.Tensor, shift: torch.Tensor, in_size: int, out_size: int
) -> torch.Tensor:
    """(B, out, in) float32 weights mapping each sample's window [start, start + length) of an
    axis to out_size samples: antialiased linear interpolation, then the shift with reflection."""
    device = start.device
    start, length = start.float()[:, None], length.float()[:, None]
    scale = length / out_size  # input pixels per output pixel
    # Output pixel i covers [start + scale i, start + scale (i + 1)); pixel centres at +0.5.
    centres = start + scale * (torch.arange(out_size, device=device) + 0.5)
    # Shift by s: output i shows resized pixel i + s, mirrored at the edges (like reflect padding).
    index = (torch.arange(out_size, device=device) + shift[:, None]).abs()
    index = torch.where(index > out_size - 1, 2 * (out_size - 1) - index, index)
    centres = centres.gather(1, index)
    taps = torch.arange(in_size, device=device) + 0.5
    # Triangle filter; when shrinking (scale > 1) it widens to `scale` pixels, which antialiases.
    support = scale.clamp(min=1.0)[..., None]
    weights = (1 - (taps - centres[..., None]).abs() / support).clamp(min=0)
    # Only pixels inside the crop box count (torchvision crops first, then resizes).
    inside = (taps >= start[..., None]) & (taps < (start + length)[..., None])
    weights = weights * inside
    return weights / weights.sum(-1, keepdim=True)


# ------------------------------------------------------------------------------------------------ #
# The loader side: workers hand over bytes and parameters
# ------------------------------------------------------------------------------------------------ #


class DeviceAugmentDataset(AugmentedDataset):
    """Samples ``(stored image, label, params, image_size)`` for augmentation on the device.

    ``base`` returns square ``image_size`` x ``image_size`` images, as uint8 (3, S, S) or as
    encoded JPEG bytes (``ShardDataset(..., decode=False)``); they are passed on as they are. The
    parameters are drawn from the key's seed, so they depend only on (seed, epoch, index), like
    the CPU augmentation. Load it with ``construct_device_loader``. With ``skip_corrupt``, a
    sample the base refuses (``CorruptImageError``: bad bytes, too many pixels) comes back as
    ``Skipped``, dropped and named by the collate as on the CPU path.
    """

    def __init__(self, base, augment: DeviceAugment, train: bool, skip_corrupt: bool = False):
        # No per-sample transform: transform_factory is never called.
        super().__init__(base, transform_factory=None, train=train, skip_corrupt=skip_corrupt)
        self.augment = augment

    def __getitem__(self, key: Key) -> tuple[torch.Tensor, int, torch.Tensor, int] | Skipped:
        index, seed, image_size = key
        loaded = load_or_skip(self.base, index, self.skip_corrupt)
        if isinstance(loaded, Skipped):
            return loaded
        data, label = loaded
        side = self.base.image_size
        generator = torch.Generator().manual_seed(seed)
        return data, label, self.augment.sample(side, side, image_size, generator), image_size


class DeferredBatch(NamedTuple):
    """A batch before augmentation. For JPEG shards ``images`` holds the files back to back and
    ``lengths`` their sizes; for raw shards ``images`` is uint8 (B, 3, S, S) and ``lengths`` is
    empty. A NamedTuple so that the DataLoader pins every tensor in it."""

    images: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    params: torch.Tensor
    image_size: int
    num_skipped: int = 0  # a SkipCount naming the samples dropped as corrupt


def collate_deferred(samples: Sequence[tuple | Skipped]) -> DeferredBatch:
    samples, skipped = kept_and_skipped(samples)
    if not samples:  # every sample was corrupt: an empty batch (B = 0)
        empty = torch.empty(0, dtype=torch.int64)
        return DeferredBatch(torch.empty(0, dtype=torch.uint8), empty, empty,
                             torch.empty(0), 0, skipped)  # fmt: skip
    data, labels, params, sizes = zip(*samples)
    encoded = data[0].ndim == 1
    return DeferredBatch(
        images=torch.cat(data) if encoded else torch.stack(data),
        lengths=torch.tensor([len(d) for d in data] if encoded else [], dtype=torch.int64),
        labels=torch.tensor(labels, dtype=torch.int64),
        params=torch.stack(params),
        image_size=sizes[0],  # the sampler gives every key of an epoch the same size
        num_skipped=skipped,
    )


def construct_device_loader(dataset: DeviceAugmentDataset, **kwargs) -> DataLoader:
    """``construct_loader`` (same arguments) for a ``DeviceAugmentDataset``: batches are
    ``DeferredBatch``es, for ``DeviceAugmentBatches``."""
    if not isinstance(dataset, DeviceAugmentDataset):
        raise TypeError(f"construct_device_loader needs a DeviceAugmentDataset, got {dataset!r}")
    loader = construct_loader(dataset, **kwargs)
    # Same sampler, workers, pinning and seeding; only the batching differs (bytes and parameters
    # instead of finished uint8 images). DataLoader allows replacing collate_fn before iterating.
    loader.collate_fn = collate_deferred
    return loader


class DeviceAugmentBatches(DeviceBatches):
    """``DeviceBatches`` that also decode (JPEG) and augment on the device, then normalise.

    Yields ``(float32 images (B, 3, S, S), labels, 0)`` like ``DeviceBatches``, with the same
    side-stream prefetch on CUDA: the next batch's copy, decode and augmentation are queued on
    the side stream while the current batch is used. ``batch_transform(images, labels)``, if
    given, runs last on the normalised batch (the hook for mixup / cutmix).
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | str,
        mean: Sequence[float],
        std: Sequence[float],
        augment: DeviceAugment,
        channels_last: bool = False,
        batch_transform: Callable | None = None,
    ):
        super().__init__(loader, device, mean, std, channels_last)
        self.augment = augment
        self.batch_transform = batch_transform

    def _to_device(self, batch: DeferredBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not batch.labels.numel():
            images = torch.empty(0, 3, 0, 0, device=self.device)
            return images, batch.labels.to(self.device), batch.num_skipped
        if batch.lengths.numel():
            # decode_jpegs takes the bytes on the host and returns images on `device`.
            files = batch.images.split(batch.lengths.tolist())
            images = torch.stack(decode_jpegs(list(files), device=self.device))
        else:
            images = batch.images.to(self.device, non_blocking=True)
        params = batch.params.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        images = self.augment(images, params, batch.image_size).sub_(self.mean).div_(self.std)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.batch_transform is not None:
            images, labels = self.batch_transform(images, labels)
        return images, labels, batch.num_skipped
