"""A data set restricted to some of its classes, relabelled 0, 1, ... (config key DATA.CLASSES)."""

import torch

from pycls.datasets.formats.imagefolder import CorruptImageError


class ClassSubset(torch.utils.data.Dataset):
    """The samples of ``base`` whose label is in ``classes``; label ``classes[j]`` becomes ``j``.

    ``base`` must expose its labels as ``base.labels`` (every pycls data set does), so that the
    subset is found without reading any image. Other attributes (``image_size`` ...) are the
    base's.
    """

    def __init__(self, base, classes: list[int]):
        labels = torch.as_tensor(base.labels)
        known = set(labels.unique().tolist())
        missing = [k for k in classes if k not in known]
        if missing:
            raise ValueError(f"DATA.CLASSES: classes {missing} have no samples in this data set")
        self.base = base
        self.num_classes = len(classes)
        self.relabel = {k: j for j, k in enumerate(classes)}
        keep = torch.isin(labels, torch.tensor(classes, dtype=labels.dtype))
        self.indices = keep.nonzero().flatten().tolist()
        self.labels = torch.tensor([self.relabel[int(labels[i])] for i in self.indices])

    @property
    def shard_sizes(self) -> list[int] | None:
        """The kept samples of each of the base's shards (the base's order is kept)."""
        sizes = getattr(self.base, "shard_sizes", None)
        if sizes is None:
            return None
        ends = torch.tensor(sizes).cumsum(0)
        shard = torch.searchsorted(ends, torch.tensor(self.indices), right=True)
        return torch.bincount(shard, minlength=len(sizes)).tolist()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        data, _ = self.base[self.indices[index]]
        return data, int(self.labels[index])

    def load_many(self, indices: list[int]) -> list:
        """Samples ``indices`` of the subset, relabelled; a corrupt one as its
        CorruptImageError (the batched read of ``AugmentedDataset.__getitems__``)."""
        picked = [self.indices[i] for i in indices]
        base_many = getattr(self.base, "load_many", None)
        if base_many is not None:
            loaded = base_many(picked)
        else:
            loaded = []
            for i in picked:
                try:
                    loaded.append(self.base[i])
                except CorruptImageError as err:
                    loaded.append(err)
        return [
            x if isinstance(x, CorruptImageError) else (x[0], int(self.labels[j]))
            for x, j in zip(loaded, indices)
        ]

    def __getattr__(self, name):
        if name == "base":  # not set yet (during unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.base, name)
