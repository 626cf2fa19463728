"""Random images for timing runs: measures the training step without disk or decode costs."""

import torch

# Distinct images kept in memory; indexing wraps around, so memory does not grow with
# num_samples while batches still hold varied content.
POOL_SIZE = 64


class Synthetic(torch.utils.data.Dataset):
    """``num_samples`` raw ``(uint8 (3, image_size, image_size), label)`` samples, fixed by seed."""

    def __init__(self, num_samples: int, image_size: int, num_classes: int, seed: int = 0):
        if num_samples <= 0 or image_size <= 0 or num_classes <= 0:
            raise ValueError(
                "Synthetic needs positive num_samples, image_size and num_classes, got "
                f"{num_samples}, {image_size}, {num_classes}"
            )
        generator = torch.Generator().manual_seed(seed)
        pool = min(POOL_SIZE, num_samples)
        shape = (pool, 3, image_size, image_size)
        self.images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=generator)
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index % len(self.images)], int(self.labels[index])
