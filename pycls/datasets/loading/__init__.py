"""How samples become batches: the seeded sampler and the epoch orders (exact across ranks and
workers, resumable at the next sample), the DataLoader and its workers, augmentation presets on
the CPU and batched on the device, token-budget batches, class subsets, corrupt samples skipped
and named, and what the data sets promise the trainer. Reads through
``pycls.datasets.formats``."""
