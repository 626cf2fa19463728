"""Datasets (raw uint8 images), augmentation presets and the seeded data loader; the data sets by
name in ``catalog``.

Leaf code: nothing here reads the global config; the trainer passes every setting explicitly.
"""

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "catalog": ["DATASETS", "DATASET_STATS", "DEFAULT_AUGMENT", "build_dataset"],
        "cifar": ["Cifar"],
        "digits": ["Digits"],
        "image_header": ["DEFAULT_MAX_PIXELS"],
        "imagefolder": ["CorruptImageError", "ImageFolder"],
        "loader": [
            "AugmentedDataset",
            "DeviceBatches",
            "SeededSampler",
            "collate_skipping",
            "construct_loader",
            "sample_seed",
        ],
        "synthetic": ["Synthetic"],
        "transforms": ["PRESETS", "build_transform"],
    },
)
