"""pycls's own shards damaged: a flipped byte is a corrupt sample naming its shard and index
(and ``prepare_dataset.py --verify`` finds it), a truncated shard fails at open or is skipped, a
garbled index is named, and a JPEG over the pixel limit is refused or skipped on the device path."""

import os
import sys

import pytest
import torch

from pycls.checkpoint import files as integrity
from pycls.datasets import CorruptImageError, Digits
from pycls.datasets.formats.prepared_shard_writer import prepare_split
from pycls.datasets.formats.prepared_shards import (
    INDEX_JSON,
    INDEX_NPZ,
    ShardDataset,
    verify_split,
)
from tests.helpers import (
    ROOT,
)
from tests.helpers.warm import run as warm_run

pytestmark = pytest.mark.usefixtures("single_thread")


def test_shard_jpeg_over_the_limit_is_refused_or_skipped_on_the_device_path(tmp_path):
    from pycls.datasets.loading.gpu_augment import (
        DeviceAugment,
        DeviceAugmentBatches,
        DeviceAugmentDataset,
        construct_device_loader,
    )

    source = torch.utils.data.Subset(Digits("train"), range(6))
    folder = tmp_path / "shards" / "train"
    prepare_split(source, folder, dataset="digits", split="train", fmt="jpeg", size=8)
    for decode in (True, False):  # decoded in the loader, or on the device
        with pytest.raises(CorruptImageError, match="declares 8 x 8 = 64 pixels, more than .* 63"):
            ShardDataset(folder.parent, "train", decode=decode, max_pixels=63)[2]
    base = ShardDataset(folder.parent, "train", decode=False, max_pixels=63)
    dataset = DeviceAugmentDataset(base, DeviceAugment("none", True), True, skip_corrupt=True)
    loader = construct_device_loader(
        dataset, batch_size=4, shuffle=False, drop_last=False, num_workers=0, pin_memory=False,
        persistent_workers=False, prefetch_factor=2, seed=0, image_size=8, skip_corrupt=True,
    )  # fmt: skip
    batches = list(DeviceAugmentBatches(loader, "cpu", (0.5,) * 3, (0.2,) * 3, dataset.augment))
    assert [(len(images), int(skipped)) for images, _, skipped in batches] == [(0, 4), (0, 2)]
    assert all("declares 8 x 8" in r for _, _, skipped in batches for r in skipped.reasons)


@pytest.fixture
def shards(tmp_path):
    source = torch.utils.data.Subset(Digits("train"), range(40))
    folder = tmp_path / "shards" / "train"
    prepare_split(source, folder, dataset="digits", split="train", shard_size=10)
    return folder


def test_flipped_shard_byte_is_a_corrupt_image_naming_shard_and_index(shards):
    shard = shards / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[3 * 192 + 5] ^= 0x10  # sample 13: the fourth of shard 1 (raw 8x8 images, 192 bytes)
    shard.write_bytes(bytes(data))
    ds = ShardDataset(shards.parent, "train")  # sizes are right: opens
    with pytest.raises(CorruptImageError, match=f"corrupt sample 13 of shard {shard}: .*CRC32"):
        ds[13]
    assert ds[12][1] == int(Digits("train").labels[12])  # the others read fine
    problems = verify_split(shards)
    assert len(problems) == 1 and "shard_00001.bin is corrupt" in problems[0]
    tool = os.path.join(ROOT, "tools", "prepare_dataset.py")
    cmd = [sys.executable, tool, "--verify", "--out", str(shards.parent)]
    result = warm_run(cmd)
    assert result.returncode == 1 and "shard_00001.bin is corrupt" in result.stderr


def test_truncated_shard_fails_at_open_or_is_skipped(shards):
    shard = shards / "shard_00002.bin"
    shard.write_bytes(shard.read_bytes()[:500])
    with pytest.raises(integrity.CorruptFileError, match=f"shard {shard} is 500 bytes, 1920 were"):
        ShardDataset(shards.parent, "train")
    with pytest.warns(UserWarning, match="skipped"):
        ds = ShardDataset(shards.parent, "train", skip_corrupt=True)
    with pytest.raises(CorruptImageError, match=f"sample 23 of shard {shard}: .*truncated"):
        ds[23]


@pytest.mark.parametrize("name, garbage", [(INDEX_JSON, b"{not json"), (INDEX_NPZ, None)])
def test_garbled_shard_index_is_named(shards, name, garbage):
    path = shards / name
    path.write_bytes(garbage if garbage is not None else path.read_bytes()[:100])
    with pytest.raises(integrity.CorruptFileError, match=f"{path}"):
        ShardDataset(shards.parent, "train")
