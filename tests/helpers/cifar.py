"""CIFAR-10/100 in the official python-pickle layout, a few random images per file."""

import pickle

import numpy as np


def write_pickle(path, entry):
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=2)


def make_cifar(root, num_classes, per_file=3, seed=0):
    """Write the official layout with a few random images per file; returns {split: (x, y)}."""
    rng = np.random.default_rng(seed)
    if num_classes == 10:
        folder = root / "cifar-10-batches-py"
        files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    else:
        folder = root / "cifar-100-python"
        files = {"train": ["train"], "test": ["test"]}
    folder.mkdir(parents=True)
    expected = {}
    for split, names in files.items():
        xs, ys = [], []
        for name in names:
            data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
            labels = rng.integers(0, num_classes, per_file).tolist()
            entry = {"data": data, "filenames": [f"{name}_{i}.png" for i in range(per_file)]}
            if num_classes == 10:
                entry.update(labels=labels, batch_label=name)
            else:
                entry.update(fine_labels=labels, coarse_labels=[y // 5 for y in labels])
            write_pickle(folder / name, entry)
            xs.append(data)
            ys += labels
        expected[split] = (np.concatenate(xs), ys)
    return folder, expected
