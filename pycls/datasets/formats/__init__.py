"""What a data file's bytes mean: image folders, CIFAR's pickles, the bundled digits, synthetic
images, pycls's own memory-mapped shards, WebDataset tar shards, Hugging Face parquet files, the
writers of the three shard formats (``pycls prepare``), which files of a path hold a split, and
the data sets by name (``catalog``). Reads through ``pycls.datasets.transport``."""
