"""Data: what a run reads, in three rooms, each importing only the ones below it.

- ``transport``: how bytes arrive: local files and URLs (http(s) by the standard library, the
  other protocols through fsspec), byte ranges, retries, read deadlines, the errors of reading,
  and the rules of what a URL read may be given (secrets only as ``${VAR}``, attempts bounded).
- ``formats``: what the bytes mean: image folders, CIFAR, the bundled digits, synthetic images,
  pycls's own shards, WebDataset tars, parquet files, their writers, and the data sets by name
  (``catalog``).
- ``loading``: how samples become batches: the seeded sampler and epoch orders, the loaders,
  augmentation presets (on the CPU or the device), token batches, corrupt samples skipped.

Leaf code: nothing here reads the global config; the builders pass every setting explicitly.
"""

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "formats.catalog": ["DATASETS", "DATASET_STATS", "DEFAULT_AUGMENT", "build_dataset"],
        "formats.cifar": ["Cifar"],
        "formats.digits": ["Digits"],
        "formats.image_header": ["DEFAULT_MAX_PIXELS"],
        "formats.imagefolder": ["CorruptImageError", "ImageFolder"],
        "loading.loader": [
            "AugmentedDataset",
            "DeviceBatches",
            "SeededSampler",
            "collate_skipping",
            "construct_loader",
            "sample_seed",
        ],
        "formats.synthetic": ["Synthetic"],
        "loading.transforms": ["PRESETS", "build_transform"],
    },
)
