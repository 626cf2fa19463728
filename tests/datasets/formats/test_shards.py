"""Shards: preparation (ImageFolder, CIFAR, digits), resuming, bad images, reading, and the loader
under two gloo processes. Everything is generated in tmp_path."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pycls.checkpoint.files import CorruptFileError
from pycls.datasets import (
    AugmentedDataset,
    Cifar,
    Digits,
    ImageFolder,
    build_transform,
    construct_loader,
)
from pycls.datasets.formats.decode import decode_jpegs
from pycls.datasets.formats.prepared_shard_writer import prepare_split
from pycls.datasets.formats.prepared_shards import (
    BAD_IMAGES,
    INDEX_JSON,
    MANIFEST,
    ShardDataset,
    verify_split,
)
from pycls.datasets.formats.shard_writing import resize_center_square
from pycls.errors import EXIT_ENVIRONMENT, reported
from tests.helpers import ROOT, free_port, load_tool, scaled
from tests.helpers.cifar import make_cifar


def _smooth_image(rng, height, width):
    """A natural-looking uint8 (3, H, W) image: coarse random colours, bicubically upsampled."""
    coarse = torch.from_numpy(rng.random((1, 3, 4, 5), dtype=np.float32)) * 255
    image = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic")
    return image[0].clamp(0, 255).round().to(torch.uint8)


def _save(image, path, **kwargs):
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(path, **kwargs)


def _image_tree(root, suffix, num_per_class=3, sizes=((20, 30), (24, 16), (16, 16))):
    """root/train/{a,b}/ with smooth images of several shapes; returns [(path, image, label)]."""
    rng = np.random.default_rng(0)
    items = []
    for label, name in enumerate(("a", "b")):
        (root / "train" / name).mkdir(parents=True)
        for i in range(num_per_class):
            image = _smooth_image(rng, *sizes[i % len(sizes)])
            path = root / "train" / name / f"{i}{suffix}"
            _save(image, path, **({"quality": 95} if suffix == ".jpg" else {}))
            items.append((path, image, label))
    return items


class Indexed(torch.utils.data.Dataset):
    """n images of 8x8 pixels, each filled with its own index; labels index % 3."""

    num_classes = 3

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.full((3, 8, 8), index, dtype=torch.uint8), index % 3


# ---------------------------------------------------------------------------------------------
# Preparation and round trips


def test_resize_policy_shorter_side_then_centre_square():
    # A 20 x 60 image: red left quarter, green middle half, blue right quarter.
    image = torch.zeros(3, 20, 60, dtype=torch.uint8)
    image[0, :, :15], image[1, :, 15:45], image[2, :, 45:] = 255, 255, 255
    out = resize_center_square(image, 10)  # 20 x 60 -> 10 x 30 -> centre 10 x 10: all green
    assert out.shape == (3, 10, 10)
    assert out[1].min() == 255 and out[0].max() == 0 and out[2].max() == 0
    tall = resize_center_square(torch.zeros(3, 50, 20, dtype=torch.uint8), 16)
    assert tall.shape == (3, 16, 16)


def test_raw_round_trip_is_exact(tmp_path):
    items = _image_tree(tmp_path / "imgs", ".png")  # PNG: lossless sources
    source = ImageFolder(tmp_path / "imgs", "train")
    result = prepare_split(
        source, tmp_path / "shards" / "train", dataset="imagefolder", split="train", size=16
    )
    assert result.complete and result.num_samples == len(items) and not result.bad
    shards = ShardDataset(tmp_path / "shards", "train")
    assert len(shards) == len(source) and shards.image_size == 16 and shards.format == "raw"
    assert shards.classes == ["a", "b"] and shards.num_classes == 2
    for i in range(len(shards)):
        image, label = shards[i]
        expected, expected_label = source[int(shards.source_index[i])]
        assert image.dtype == torch.uint8 and image.shape == (3, 16, 16)
        assert torch.equal(image, resize_center_square(expected, 16))
        assert label == expected_label


def test_jpeg_round_trip_psnr(tmp_path):
    _image_tree(tmp_path / "imgs", ".png", sizes=((64, 80), (72, 64), (64, 64)))
    source = ImageFolder(tmp_path / "imgs", "train")
    options = dict(dataset="x", split="train", size=64)
    raw = prepare_split(source, tmp_path / "raw" / "train", **options)
    jpeg = prepare_split(source, tmp_path / "jpg" / "train", fmt="jpeg", quality=90, **options)
    assert raw.num_samples == jpeg.num_samples == len(source)
    assert jpeg.nbytes < raw.nbytes / 4
    exact, lossy = ShardDataset(tmp_path / "raw", "train"), ShardDataset(tmp_path / "jpg", "train")
    encoded = ShardDataset(tmp_path / "jpg", "train", decode=False)
    for i in range(len(exact)):
        (a, la), (b, lb) = exact[i], lossy[i]
        assert la == lb and b.shape == a.shape == (3, 64, 64)
        # Quality 90 on smooth 64 px images: PSNR >= 38 dB (41-45 dB seen; mean squared error
        # <= 10.3 grey levels^2). Tiny images do worse (~26 dB at 16 px: 4:2:0 chroma).
        mse = (a.double() - b.double()).pow(2).mean().item()
        assert 10 * np.log10(255**2 / max(mse, 1e-12)) >= 38, i
        data, _ = encoded[i]
        assert data.ndim == 1 and torch.equal(decode_jpegs(data), b)


@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_pickles_prepare_at_native_size(tmp_path, num_classes):
    make_cifar(tmp_path / "cifar", num_classes)
    for split in ("train", "test"):
        source = Cifar(tmp_path / "cifar", split, num_classes=num_classes)
        name = f"cifar{num_classes}"
        prepare_split(source, tmp_path / "shards" / split, dataset=name, split=split)
        shards = ShardDataset(tmp_path / "shards", split)
        assert shards.image_size == 32 and shards.num_classes == num_classes
        assert shards.dataset == name and len(shards) == len(source)
        for i in range(len(shards)):
            assert torch.equal(shards[i][0], source[i][0]) and shards[i][1] == source[i][1]
    assert len(ShardDataset(tmp_path / "shards", "val")) == len(shards)  # val = test


def test_corrupt_image_reported_and_skipped(tmp_path):
    items = _image_tree(tmp_path / "imgs", ".jpg")
    bad = tmp_path / "imgs" / "train" / "a" / "broken.jpg"
    bad.write_bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes())
    source = ImageFolder(tmp_path / "imgs", "train")
    folder = tmp_path / "shards" / "train"
    result = prepare_split(
        source, folder, dataset="imagefolder", split="train", size=12, fmt="jpeg", shard_size=2
    )
    assert result.complete and result.num_samples == len(items)
    assert [path for path, _ in result.bad] == [str(bad)]
    lines = (folder / BAD_IMAGES).read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{bad}\t")
    summary = result.summary()
    assert "1 bad image(s)" in summary and str(folder / BAD_IMAGES) in summary
    shards = ShardDataset(tmp_path / "shards", "train")
    assert len(shards) == len(items)
    assert json.loads((folder / INDEX_JSON).read_text())["num_bad"] == 1
    # The rest is all there, in source order, with the right labels.
    kept = [i for i, (path, _) in enumerate(source.samples) if path != str(bad)]
    assert shards.source_index.tolist() == kept
    assert shards.labels.tolist() == [source.samples[i][1] for i in kept]


def _snapshot(folder):
    """Every file's content; .npz compared by arrays (zip entries carry timestamps)."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".npz":
            with np.load(path) as arrays:
                files[path.name] = {k: arrays[k].tolist() for k in arrays.files}
        else:
            files[path.name] = path.read_bytes()
    return files


def test_interrupted_preparation_resumes(tmp_path):
    source = Indexed(10)
    options = dict(dataset="indexed", split="train", fmt="jpeg", shard_size=4)
    reference = prepare_split(source, tmp_path / "once" / "train", **options)
    assert reference.complete and reference.num_shards == 3

    folder = tmp_path / "twice" / "train"
    first = prepare_split(source, folder, stop_after=1, **options)
    assert not first.complete and first.shards_written == 1 and "rerun" in first.summary()
    assert (folder / MANIFEST).is_file() and not (folder / INDEX_JSON).exists()
    with pytest.raises(FileNotFoundError, match="unfinished"):
        ShardDataset(tmp_path / "twice", "train")
    (folder / "shard_00001.bin.tmp").write_bytes(b"half a shard from a killed run")
    progress = []
    second = prepare_split(source, folder, workers=2, on_progress=progress.append, **options)
    assert second.complete and (second.shards_skipped, second.shards_written) == (1, 2)
    assert sum(progress) == 10  # the finished shard counts at once, the others as they finish
    assert _snapshot(folder) == _snapshot(tmp_path / "once" / "train")
    # Complete: a third run writes nothing.
    assert prepare_split(source, folder, **options).shards_written == 0
    # Other settings on an existing preparation are refused, naming the folder.
    with pytest.raises(ValueError, match="other settings"):
        prepare_split(source, folder, **(options | {"fmt": "raw"}))


def test_tool_prepares_bundled_digits(tmp_path, capsys):
    tool = load_tool("prepare_dataset")
    assert tool.main(["--dataset", "digits", "--out", str(tmp_path), "--splits", "test"]) == 0
    assert "359 images" in capsys.readouterr().out
    shards, digits = ShardDataset(tmp_path, "test"), Digits("test")
    assert shards.dataset == "digits" and shards.image_size == 8
    assert torch.equal(torch.stack([shards[i][0] for i in range(len(shards))]), digits.images)
    assert torch.equal(shards.labels, digits.labels)
    with pytest.raises(SystemExit):  # cifar needs --data
        tool.parse_args(["--dataset", "cifar10", "--out", str(tmp_path)])


def test_missing_split_names_what_exists(tmp_path):
    prepare_split(Indexed(4), tmp_path / "train", dataset="indexed", split="train")
    with pytest.raises(FileNotFoundError, match=r"'val'.*\['train'\]"):
        ShardDataset(tmp_path, "val")


# ---------------------------------------------------------------------------------------------
# The loader over shards in two processes


def _loader_kwargs(rank):
    # No worker processes: inside a spawned process they would be spawned too (seconds each),
    # and the sharding under test is the sampler's, in the main process.
    return dict(
        batch_size=3, shuffle=True, drop_last=False, num_workers=0, pin_memory=False,
        persistent_workers=False, prefetch_factor=2, seed=5, image_size=8, rank=rank,
        world_size=2,
    )  # fmt: skip


def _epoch_in_process(rank, port, path, out):
    import torch.distributed as dist

    from pycls.datasets.loading.gpu_augment import (
        DeviceAugment,
        DeviceAugmentBatches,
        DeviceAugmentDataset,
        construct_device_loader,
    )

    torch.set_num_threads(1)  # forked: the parent's OpenMP pool is unusable here (as in workers)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    kwargs = _loader_kwargs(dist.get_rank())
    seen = {}
    # Per-sample CPU augmentation ("none" at the stored size is the identity) ...
    factory = functools.partial(build_transform, "none")
    dataset = AugmentedDataset(ShardDataset(path, "train"), factory, train=True)
    loader = construct_loader(dataset, **kwargs)
    loader.sampler.set_epoch(1)
    seen["cpu"] = [
        (int(x[0, 0, 0]), int(y)) for images, labels, _ in loader for x, y in zip(images, labels)
    ]
    # ... and the deferred path, augmented on this process's "device" (the CPU here).
    deferred = DeviceAugmentDataset(ShardDataset(path, "train"), DeviceAugment("none", True), True)
    loader = construct_device_loader(deferred, **kwargs)
    loader.sampler.set_epoch(1)
    batches = DeviceAugmentBatches(loader, "cpu", (0.0,) * 3, (1 / 255,) * 3, deferred.augment)
    seen["device"] = [
        (round(float(x[0, 0, 0])), int(y))
        for images, labels, _ in batches
        for x, y in zip(images, labels)
    ]
    gathered = [None, None]
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def test_loader_under_two_gloo_processes_sees_each_sample_once(tmp_path):
    prepare_split(Indexed(10), tmp_path / "train", dataset="indexed", split="train")
    out = tmp_path / "seen.json"
    # torch.multiprocessing.spawn's machinery with fork: the children inherit the imported torch
    # instead of importing it again (~10 s each on a busy 2-core machine).
    torch.multiprocessing.start_processes(
        _epoch_in_process,
        args=(free_port(), str(tmp_path), str(out)),
        nprocs=2,
        start_method="fork",
    )
    ranks = json.loads(out.read_text())
    for path in ("cpu", "device"):
        per_rank = [[tuple(s) for s in r[path]] for r in ranks]
        assert [len(s) for s in per_rank] == [5, 5]
        samples = sorted(per_rank[0] + per_rank[1])
        assert samples == [(i, i % 3) for i in range(10)], path  # every image once, right label
    # Both paths give each rank the same samples in the same order.
    assert [r["cpu"] for r in ranks] == [r["device"] for r in ranks]


# ---------------------------------------------------------------------------------------------
# A crafted index: sizes it claims are checked before anything is allocated


@pytest.fixture
def digit_shards(tmp_path):
    source = torch.utils.data.Subset(Digits("train"), range(40))
    folder = tmp_path / "shards" / "train"
    prepare_split(source, folder, dataset="digits", split="train", shard_size=10)
    return folder


_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _rewrite_index(folder, edit):
    """Rewrites the split's index.npz member by member through ``edit(name, header, data)`` ->
    (header, data, compress_type), and records the new file's size and checksum in index.json,
    as a crafted set would (the checksum is no defence by itself)."""
    import io
    import zipfile

    from pycls.checkpoint.files import file_record
    from pycls.datasets.formats.prepared_shards import INDEX_NPZ, _fields_crc32

    path = folder / INDEX_NPZ
    members = []
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            raw = io.BytesIO(archive.read(info))
            version = np.lib.format.read_magic(raw)
            shape, fortran, dtype = _HEADER_READERS[version](raw)
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran,
                      "shape": shape}  # fmt: skip
            members.append((info.filename, *edit(info.filename, header, raw.read())))
    with zipfile.ZipFile(path, "w") as archive:
        for name, header, data, compress in members:
            buf = io.BytesIO()
            np.lib.format.write_array_header_1_0(buf, header)
            archive.writestr(zipfile.ZipInfo(name), buf.getvalue() + data, compress_type=compress)
    info = json.loads((folder / INDEX_JSON).read_text())
    info["index_checksum"] = file_record(path)
    info["fields_crc32"] = _fields_crc32(info)  # sealed again, as a crafted set would be
    (folder / INDEX_JSON).write_text(json.dumps(info))


def _claims_2_40_labels(name, header, data):
    if name.startswith("labels"):
        header = {**header, "shape": (2**40,)}
    return header, data, zipfile.ZIP_STORED


def _claims_one_more_label(name, header, data):
    if name.startswith("labels"):
        header = {**header, "shape": (header["shape"][0] + 1,)}
    return header, data, zipfile.ZIP_STORED


def _compressed(name, header, data):  # savez writes stored members: deflate would hide sizes
    return header, data, zipfile.ZIP_DEFLATED


@pytest.mark.parametrize(
    "edit, words",
    [
        (_claims_2_40_labels, "labels.npy claims 8796093022208 bytes"),
        (_claims_one_more_label, "labels.npy claims 328 bytes"),
        (_compressed, "is compressed"),
    ],
)
def test_sizes_a_crafted_index_claims_are_checked_before_they_are_allocated(
    digit_shards, edit, words
):
    shards = digit_shards
    import resource

    from pycls.checkpoint.files import CorruptFileError

    _rewrite_index(shards, edit)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptFileError, match=words):
        ShardDataset(shards.parent, "train")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB


def test_an_index_that_is_a_fifo_is_refused_without_blocking(digit_shards):
    shards = digit_shards
    import os
    import threading

    from pycls.checkpoint.files import CorruptFileError
    from pycls.datasets.formats.prepared_shards import INDEX_NPZ

    info = json.loads((shards / INDEX_JSON).read_text())
    del info["index_checksum"]  # as an older pycls wrote it: nothing to verify first
    del info["fields_crc32"]
    (shards / INDEX_JSON).write_text(json.dumps(info))
    os.remove(shards / INDEX_NPZ)
    os.mkfifo(shards / INDEX_NPZ)
    outcome = []

    def run():
        try:
            ShardDataset(shards.parent, "train")
        except Exception as e:  # the outcome to check
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(scaled(10))
    assert outcome and isinstance(outcome[0], CorruptFileError), outcome
    assert "no regular file" in str(outcome[0])


# ------------------------------------------------------------------------------------------------ #
# A preparation killed at any point: no orphan, nothing partial, and the rerun finishes it
# ------------------------------------------------------------------------------------------------ #

# The digits resized to 384 px and re-encoded (about 3 ms and 9 KB an image): 3 shards of a
# second or more each, two workers
_SLOW_PREPARE = ["--dataset", "digits", "--splits", "train", "--size", "384", "--format", "jpeg"]
_SLOW_PREPARE += ["--shard-size", "480", "--workers", "2"]


def _prepare_cmd(out):
    return [sys.executable, os.path.join(ROOT, "tools", "prepare_dataset.py"), *_SLOW_PREPARE,
            "--out", str(out)]  # fmt: skip


def _files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    subprocess.run(_prepare_cmd(out), check=True, capture_output=True, timeout=scaled(300))
    return _files_of(out / "train")


def _processes_naming(text):
    """Pids of the live processes whose command line holds ``text`` (zombies have none)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def _shards_recorded(folder):
    try:
        return len(json.loads((folder / "manifest.json").read_text())["shards"])
    except (OSError, ValueError):
        return 0


def _a_shard_just_started(folder, recorded):
    """Whether at least ``recorded`` shards are done and a worker has just begun another (its
    temporary file holds less than 60 of its 480 images): that worker has a second of work
    left."""
    if _shards_recorded(folder) < recorded:
        return False
    for tmp in folder.glob("shard_*.bin.tmp*"):
        try:
            if tmp.stat().st_size < 60 * 9000:
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("shards_done, sig", [(0, signal.SIGKILL), (1, signal.SIGTERM)])
def test_a_killed_preparation_leaves_no_process_and_the_rerun_finishes_it(
    tmp_path, uninterrupted, shards_done, sig
):
    """The parent killed just as a worker began a shard, with SIGKILL at the first shard and
    SIGTERM at the second (each signal and each point once: the workers end on their parent's
    death whatever killed it, so the other two pairings, run until 2026-11, add nothing): the
    workers die with it (they wrote on for the rest of their shard, racing the rerun the docs
    recommend for the file names), nothing but complete shards carry a final name, and the
    immediate rerun finishes the preparation, byte-identical to an uninterrupted one.

    Tried on broken copies (2026-11-27): a shard written in place of its temporary name fails
    both; workers that no longer die with their parent pass both here (a shard this small ends
    within the 0.5 s allowed): test_a_writer_without_prctl_still_dies_with_its_parent holds
    that part."""
    out = tmp_path / "killed"
    proc = subprocess.Popen(_prepare_cmd(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + scaled(120)
    while time.monotonic() < deadline and proc.poll() is None:
        if _a_shard_just_started(out / "train", shards_done):
            break
        time.sleep(0.002)
    assert proc.poll() is None, "the preparation ended before the kill point"
    os.kill(proc.pid, sig)
    proc.wait(timeout=scaled(30))
    deadline = time.monotonic() + scaled(0.5)  # not the rest of a shard: they go with the parent
    while _processes_naming(str(out)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _processes_naming(str(out)) == [], "workers outlived their preparation"
    rerun = subprocess.run(_prepare_cmd(out), capture_output=True, text=True, timeout=scaled(300))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert _files_of(out / "train") == uninterrupted
    assert verify_split(out / "train") == []


def test_a_shard_is_read_back_before_it_gets_its_name(tmp_path, monkeypatch):
    """Bytes lost between the write and the disk without an error (a failing disk, a full one
    that did not say so): the shard fails its check, no file takes its final name, nothing is
    left, and the preparation is not recorded as done."""
    source = Indexed(12)
    real_fsync = os.fsync

    def losing_fsync(fd):
        if os.fstat(fd).st_size > 100:  # a shard's data file
            os.ftruncate(fd, 100)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", losing_fsync)
    folder = tmp_path / "train"
    with pytest.raises(CorruptFileError, match="shard being written .* 100 bytes") as e:
        prepare_split(source, folder, dataset="indexed", split="train", shard_size=6)
    assert sorted(p.name for p in folder.iterdir()) == []
    assert reported(e.value)[0] == EXIT_ENVIRONMENT  # the machine's failure, not the input's


_ORPHAN = """
import os, sys, time
from pycls.datasets.formats import shard_writing as shards
sys.platform = "other"  # no prctl: the watching thread alone
parent, (ready, tell) = os.getpid(), os.pipe()
child = os.fork()
if child == 0:
    shards.die_with_parent(parent)
    os.write(tell, b"r")
    time.sleep(60)
    os._exit(0)
os.close(tell)
assert os.read(ready, 1) == b"r", "the child did not get ready"
print(child, flush=True)
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_writer_without_prctl_still_dies_with_its_parent(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", _ORPHAN]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120), env=env)
    child = int(out.stdout)
    deadline = time.monotonic() + scaled(2)
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the writer outlived its parent")
