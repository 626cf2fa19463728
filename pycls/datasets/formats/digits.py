"""The 8x8 handwritten digits that ship with scikit-learn: a tiny real dataset needing no download.

1,797 images from the UCI optical recognition of handwritten digits set, 16 grey levels. Used for
smoke tests and end-to-end training checks that must finish in seconds on a CPU.
"""

import functools

import numpy as np
import torch

NUM_CLASSES = 10
TEST_FRACTION = 0.2
_SPLITS = {"train": False, "test": True, "val": True}  # split -> is the held-out part


def _split_indices(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stratified train/test indices, fixed forever.

    The legacy RandomState stream is frozen by numpy's compatibility policy, unlike sklearn's
    splitters whose internals may change between versions; a moving test set would make results
    across versions incomparable.
    """
    rng = np.random.RandomState(0)
    train, test = [], []
    for digit in range(NUM_CLASSES):
        members = rng.permutation(np.flatnonzero(labels == digit))
        num_test = round(TEST_FRACTION * len(members))
        test.append(members[:num_test])
        train.append(members[num_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


@functools.cache
def _load(held_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # Imported here so that importing pycls.datasets does not pull in scikit-learn.
    from sklearn.datasets import load_digits

    bunch = load_digits()
    labels = np.asarray(bunch.target, dtype=np.int64)
    # Grey levels 0..16 -> 0..255, one channel replicated to RGB like every other dataset here.
    grey = np.rint(np.asarray(bunch.images) * (255.0 / 16.0)).astype(np.uint8)
    images = torch.from_numpy(np.repeat(grey[:, None], 3, axis=1))
    indices = torch.from_numpy(_split_indices(labels)[1 if held_out else 0])
    return images[indices].contiguous(), torch.from_numpy(labels)[indices].contiguous()


class Digits(torch.utils.data.Dataset):
    """Raw ``(uint8 (3, 8, 8), label)`` samples; ``split`` is "train" or "test" ("val" = "test")."""

    num_classes = NUM_CLASSES

    def __init__(self, split: str):
        if split not in _SPLITS:
            raise ValueError(f"unknown digits split {split!r}; expected one of {sorted(_SPLITS)}")
        self.images, self.labels = _load(_SPLITS[split])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])
