"""CIFAR-10 / CIFAR-100 from the official python-pickle release.

A small reader of our own rather than torchvision's CIFAR classes: those verify the md5 sums of
the official files, which rejects the small generated files the tests use. Only shapes are
checked here. The batches are pickles, read as data: only numpy arrays and plain containers
are allowed (pycls.checkpoint.unpickle), so a crafted file cannot run code.
"""

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from pycls.checkpoint import unpickle

# num_classes -> (folder name, train files, test files, label key)
_LAYOUTS = {
    10: (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        "labels",
    ),
    100: ("cifar-100-python", ["train"], ["test"], "fine_labels"),
}
_SPLITS = {"train": 1, "test": 2, "val": 2}  # index into a layout tuple
_PIXELS = 3 * 32 * 32


def _find_folder(root: Path, folder_name: str, first_file: str) -> Path:
    # Accept both the directory that holds the extracted archive and the extracted folder itself.
    for folder in (root / folder_name, root):
        if (folder / first_file).is_file():
            return folder
    raise FileNotFoundError(
        f"CIFAR files not found: expected {root / folder_name / first_file} "
        f"(or {root / first_file})"
    )


def _load_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"CIFAR file not found: {path}")
    try:
        with open(path, "rb") as f:
            # latin1: the official pickles were written by Python 2 with byte-string keys.
            entry = unpickle.load(f, unpickle.NUMPY_ARRAYS, path, encoding="latin1")
        data = np.asarray(entry["data"], dtype=np.uint8)
        labels = np.asarray(entry[label_key], dtype=np.int64)
    except unpickle.UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"malformed CIFAR file {path}: {err!r}") from err
    if data.ndim != 2 or data.shape[1] != _PIXELS or labels.shape != (data.shape[0],):
        raise ValueError(
            f"malformed CIFAR file {path}: data {data.shape}, labels {labels.shape}; "
            f"expected (N, {_PIXELS}) and (N,)"
        )
    return data, labels


class Cifar(torch.utils.data.Dataset):
    """Raw ``(uint8 (3, 32, 32), label)`` samples of CIFAR-10 or CIFAR-100 (fine labels)."""

    def __init__(self, root: str | os.PathLike, split: str, num_classes: int = 10):
        if num_classes not in _LAYOUTS:
            raise ValueError(f"CIFAR num_classes must be 10 or 100, got {num_classes}")
        if split not in _SPLITS:
            raise ValueError(f"unknown CIFAR split {split!r}; expected one of {sorted(_SPLITS)}")
        layout = _LAYOUTS[num_classes]
        files, label_key = layout[_SPLITS[split]], layout[3]
        folder = _find_folder(Path(root), layout[0], files[0])
        batches = [_load_batch(folder / name, label_key) for name in files]
        data = np.concatenate([b[0] for b in batches])
        # Each row is 1024 red, then 1024 green, then 1024 blue values, each plane row-major:
        # exactly the (3, 32, 32) CHW layout.
        self.images = torch.from_numpy(data.reshape(-1, 3, 32, 32))
        self.labels = torch.from_numpy(np.concatenate([b[1] for b in batches]))
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])
