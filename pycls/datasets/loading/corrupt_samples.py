"""Corrupt samples, skipped once for every loader (DATA_LOADER.SKIP_CORRUPT): a sample whose image
a reader refuses (``CorruptImageError``: bytes that do not decode, too many pixels, a shard that
changed since it was indexed) is raised, or under ``skip_corrupt`` comes back as ``Skipped``,
carrying the reason (which names the file, or the shard and the member); a collate keeps the
other samples and counts the skipped ones in a ``SkipCount`` that names them, so the run can
list what it skipped (``pycls.datasets.loading.checks``). The CPU loader, the on-device
augmentation and the token batches all skip through here."""

from collections.abc import Sequence

from pycls.datasets.formats.imagefolder import CorruptImageError


class Skipped:
    """What a dataset returns for a corrupt sample under ``skip_corrupt``: the reason."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class SkipCount(int):
    """The ``num_skipped`` of a batch: an int that also carries the reasons (``.reasons``)."""

    def __new__(cls, reasons: Sequence[str] = ()):
        count = super().__new__(cls, len(reasons))
        count.reasons = tuple(reasons)
        return count

    def __reduce__(self):  # to the main process from loader workers
        return (SkipCount, (self.reasons,))


def skipped_or_raised(error: CorruptImageError, skip_corrupt: bool) -> Skipped:
    """``error`` as a Skipped sample under ``skip_corrupt``; raised otherwise."""
    if not skip_corrupt:
        raise error
    return Skipped(str(error))


def load_or_skip(base, index: int, skip_corrupt: bool):
    """``base[index]``, or a Skipped sample where ``base`` refuses it as corrupt."""
    try:
        return base[index]
    except CorruptImageError as error:
        return skipped_or_raised(error, skip_corrupt)


def is_skipped(sample) -> bool:
    """Whether a loaded sample was skipped (Skipped, or None from a dataset of older code)."""
    return sample is None or isinstance(sample, Skipped)


def kept_and_skipped(samples: Sequence) -> tuple[list, SkipCount]:
    """(the samples that loaded, a SkipCount naming the ones skipped)."""
    skipped = [getattr(s, "reason", "a sample") for s in samples if is_skipped(s)]
    return [s for s in samples if not is_skipped(s)], SkipCount(skipped)
