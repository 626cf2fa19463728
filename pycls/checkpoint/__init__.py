"""Everything that writes or reads a checkpoint or weights file.

- ``files``: checksummed files; folder manifests; the one ``CheckpointError`` family.
- ``unpickle``: the allowlisting unpickler (a file is data, never code).
- ``single_file``: one-file checkpoints (``.pyth``) with their RNG state.
- ``sharded``: torch.distributed.checkpoint folders (FSDP2, pipeline), consolidation.
- ``resume``: which checkpoint to resume from, and whether it still fits the config.
- ``run_lock``: one live run per OUT_DIR.
- ``weights``: weights files in and out (pycls, timm and torchvision naming; safetensors).

Imports only the leaves (``pycls.errors``, ``pycls.yaml_keys``), ``pycls.models`` and
``pycls.distributed`` (the layer order in the README's Layout section).
"""
