"""Datasets and transforms on real formats generated in tmp_path."""

import functools
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from pycls.datasets import (
    DATASET_STATS,
    DATASETS,
    DEFAULT_AUGMENT,
    PRESETS,
    AugmentedDataset,
    Cifar,
    CorruptImageError,
    Digits,
    ImageFolder,
    Synthetic,
    build_dataset,
    build_transform,
    construct_loader,
)
from tests.helpers import scaled, within
from tests.helpers.cifar import make_cifar, write_pickle

# ---------------------------------------------------------------------------------------------
# Digits


def test_digits_split_sizes_and_stability():
    from sklearn.datasets import load_digits

    train, test = Digits("train"), Digits("test")
    assert len(train) + len(test) == 1797
    assert 340 <= len(test) <= 380
    assert len(Digits("val")) == len(test)
    assert train.num_classes == 10
    assert set(train.labels.tolist()) == set(range(10))
    # Stratified: every digit has about 20 % of its images in the test split.
    assert torch.bincount(test.labels, minlength=10).min() >= 30
    # Stable across constructions (the process-wide cache hands out the same data).
    again = Digits("test")
    assert torch.equal(again.images, test.images) and torch.equal(again.labels, test.labels)
    # No overlap: together the splits hold the source images exactly once each (as multisets,
    # since the source has a few exact duplicates).
    source = np.rint(load_digits().images * (255 / 16)).astype(np.uint8)
    ours = torch.cat([train.images[:, 0], test.images[:, 0]]).numpy()
    assert sorted(map(bytes, ours.reshape(1797, -1))) == sorted(
        map(bytes, source.reshape(1797, -1))
    )


def test_digits_samples():
    """Every sample of both splits is an image of the source with the source's label for it (the
    multisets of (image, label) pairs are equal). Tried: the labels shifted by one sample against
    the images; it fails here, and passed when only the range of a label was checked."""
    from sklearn.datasets import load_digits

    image, label = Digits("train")[5]
    assert image.dtype == torch.uint8 and image.shape == (3, 8, 8)
    assert isinstance(label, int) and 0 <= label < 10
    assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])
    images = Digits("train").images
    assert images.max() == 255 and images.min() == 0
    bunch = load_digits()
    source = np.rint(bunch.images * (255 / 16)).astype(np.uint8).reshape(1797, -1)
    want = sorted(zip(map(bytes, source), bunch.target.tolist()))
    got = []
    for split in ("train", "test"):
        digits = Digits(split)
        got += [(bytes(digits[i][0][0].numpy()), digits[i][1]) for i in range(len(digits))]
    assert sorted(got) == want


def test_digits_bad_split():
    with pytest.raises(ValueError, match="split"):
        Digits("validation")


# ---------------------------------------------------------------------------------------------
# CIFAR


@pytest.mark.parametrize("num_classes", [10, 100])
def test_cifar_round_trip(tmp_path, num_classes):
    folder, expected = make_cifar(tmp_path, num_classes)
    for split in ("train", "test"):
        data, labels = expected[split]
        # Both the parent of the extracted folder and the folder itself are accepted.
        for root in (tmp_path, folder):
            ds = Cifar(root, split, num_classes=num_classes)
            assert len(ds) == len(labels) and ds.num_classes == num_classes
            for i in range(len(ds)):
                image, label = ds[i]
                assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
                assert label == labels[i]
                # Row layout: 1024 red values, then green, then blue, each plane row-major.
                row = data[i]
                assert np.array_equal(image[0].numpy().ravel(), row[:1024])
                assert np.array_equal(image[2].numpy().ravel(), row[2048:])
                assert image[1, 2, 5].item() == row[1024 + 2 * 32 + 5]
    assert len(Cifar(tmp_path, "train", num_classes)) == (15 if num_classes == 10 else 3)


def test_cifar_missing_folder_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        Cifar(tmp_path / "nowhere", "train")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        Cifar(tmp_path / "nowhere", "test", num_classes=100)


def test_cifar_missing_batch_names_file(tmp_path):
    folder, _ = make_cifar(tmp_path, 10)
    (folder / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4"):
        Cifar(tmp_path, "train")


def test_cifar_malformed_pickle_names_file(tmp_path):
    folder, _ = make_cifar(tmp_path, 10)
    (folder / "test_batch").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="test_batch"):
        Cifar(tmp_path, "test")
    write_pickle(folder / "test_batch", {"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]})
    with pytest.raises(ValueError, match="test_batch"):
        Cifar(tmp_path, "test")


# ---------------------------------------------------------------------------------------------
# ImageFolder


def _rgb(rng, h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture
def image_tree(tmp_path):
    """root/train/{cat,dog}/ with JPEGs, one PNG and one grayscale JPEG, of various sizes."""
    rng = np.random.default_rng(0)
    root = tmp_path / "imgs"
    (root / "train" / "cat").mkdir(parents=True)
    (root / "train" / "dog").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(_rgb(rng, 20 + i, 30)).save(root / "train" / "cat" / f"c{i}.jpg")
    for i in range(2):
        Image.fromarray(_rgb(rng, 24, 16)).save(root / "train" / "dog" / f"d{i}.JPEG")
    png = _rgb(rng, 12, 14)
    Image.fromarray(png).save(root / "train" / "dog" / "p.png")
    gray = rng.integers(0, 256, (18, 22), dtype=np.uint8)
    Image.fromarray(gray, mode="L").save(root / "train" / "dog" / "g.jpg")
    (root / "train" / "dog" / "notes.txt").write_text("not an image")
    return root, png


def test_imagefolder_samples(image_tree):
    root, png = image_tree
    ds = ImageFolder(root, "train")
    assert ds.classes == ["cat", "dog"] and ds.num_classes == 2
    assert len(ds) == 7  # the .txt file is not an image
    by_name = {path.rsplit("/", 1)[-1]: i for i, (path, _) in enumerate(ds.samples)}
    for name, index in by_name.items():
        image, label = ds[index]
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert label == (0 if name.startswith("c") else 1)
    assert ds[by_name["c2.jpg"]][0].shape == (3, 22, 30)
    assert ds[by_name["d0.JPEG"]][0].shape == (3, 24, 16)
    # PNG is lossless: exact pixels, HWC -> CHW.
    assert torch.equal(ds[by_name["p.png"]][0], torch.from_numpy(png).permute(2, 0, 1))
    gray = ds[by_name["g.jpg"]][0]
    assert gray.shape == (3, 18, 22)
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    # JPEG decode agrees with PIL's up to decoder rounding differences.
    with Image.open(root / "train" / "cat" / "c0.jpg") as im:
        reference = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
    assert (ds[by_name["c0.jpg"]][0].int() - reference.int()).abs().max() <= 3


def test_imagefolder_missing_and_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing" / "train")):
        ImageFolder(tmp_path / "missing", "train")
    (tmp_path / "root" / "val").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "root" / "val")):
        ImageFolder(tmp_path / "root", "val")  # no class folders
    (tmp_path / "root" / "val" / "cls").mkdir()
    (tmp_path / "root" / "val" / "cls" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "root" / "val")):
        ImageFolder(tmp_path / "root", "val")  # class folders but no images


def _add_corrupt(root):
    bad = root / "train" / "cat" / "broken.jpg"
    bad.write_bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes())
    return bad


def test_imagefolder_corrupt_file_error(image_tree):
    root, _ = image_tree
    bad = _add_corrupt(root)
    ds = ImageFolder(root, "train")
    index = [path for path, _ in ds.samples].index(str(bad))
    with pytest.raises(CorruptImageError, match="broken.jpg") as info:
        ds[index]
    assert isinstance(info.value, ValueError)
    assert str(bad) in str(info.value)
    (root / "train" / "cat" / "empty.jpg").write_bytes(b"")
    ds = ImageFolder(root, "train")
    index = [path for path, _ in ds.samples].index(str(root / "train" / "cat" / "empty.jpg"))
    with pytest.raises(CorruptImageError, match="empty.jpg"):
        ds[index]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_skips_corrupt(image_tree, num_workers):
    root, _ = image_tree
    _add_corrupt(root)
    base = ImageFolder(root, "train")
    dataset = AugmentedDataset(base, functools.partial(build_transform, "imagenet"), train=True)
    kwargs = dict(
        batch_size=3,
        shuffle=True,
        drop_last=False,
        num_workers=num_workers,
        pin_memory=False,
        persistent_workers=False,
        prefetch_factor=2,
        seed=0,
        image_size=16,
    )
    loader = construct_loader(dataset, skip_corrupt=True, **kwargs)
    seen, skipped = 0, 0
    for images, labels, num_skipped in loader:
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert images.shape[1:] == (3, 16, 16) and len(images) == len(labels)
        seen += len(labels)
        skipped += num_skipped
    assert (seen, skipped) == (len(base) - 1, 1)
    assert dataset.skip_corrupt is False  # the caller's dataset keeps its own policy
    if num_workers == 0:  # with workers the error is re-raised under another type
        with pytest.raises(CorruptImageError, match="broken.jpg"):
            list(construct_loader(dataset, **kwargs))


def _unreadable_files(root):
    """Files listed as samples that cannot be read: a dangling link, a link into a folder that
    was removed, and an image removed after the folder was listed. Returns their paths."""
    cat = root / "train" / "cat"
    (cat / "dangling.jpg").symlink_to(cat / "no_such_file.jpg")
    gone = root / "gone"
    gone.mkdir()
    (gone / "x.jpg").write_bytes(b"")
    (cat / "into_gone.jpg").symlink_to(gone / "x.jpg")
    return [cat / "dangling.jpg", cat / "into_gone.jpg", cat / "c1.jpg"]


def _remove_after_listing(root):
    shutil.rmtree(root / "gone")
    os.remove(root / "train" / "cat" / "c1.jpg")


@pytest.mark.parametrize("num_workers", [0, 1])
def test_files_that_cannot_be_read_are_corrupt_samples_skipped_and_named(image_tree, num_workers):
    """Whatever keeps a listed file from being read is a corrupt sample like one that does not
    decode: named, and skipped under DATA_LOADER.SKIP_CORRUPT (it ended the run)."""
    root, _ = image_tree
    unreadable = _unreadable_files(root)
    base = ImageFolder(root, "train")
    _remove_after_listing(root)
    paths = [path for path, _ in base.samples]
    for path in unreadable:
        with pytest.raises(CorruptImageError, match=f"cannot read image {path}: "):
            base[paths.index(str(path))]
    dataset = AugmentedDataset(base, functools.partial(build_transform, "imagenet"), train=True)
    kwargs = dict(batch_size=4, shuffle=False, drop_last=False, num_workers=num_workers)
    kwargs.update(pin_memory=False, persistent_workers=False, prefetch_factor=2, seed=0)
    loader = construct_loader(dataset, skip_corrupt=True, image_size=16, **kwargs)
    seen, reasons = 0, []
    for _, labels, num_skipped in loader:
        seen += len(labels)
        reasons += num_skipped.reasons
    assert seen == len(base) - 3 and len(reasons) == 3
    for path in unreadable:
        assert any(r.startswith(f"cannot read image {path}: ") for r in reasons), reasons


# ---------------------------------------------------------------------------------------------
# Synthetic and the registry


def test_synthetic():
    ds = Synthetic(200, 24, 7, seed=3)
    assert len(ds) == 200 and ds.num_classes == 7
    image, label = ds[150]
    assert image.shape == (3, 24, 24) and image.dtype == torch.uint8 and 0 <= label < 7
    assert torch.equal(ds[150][0], Synthetic(200, 24, 7, seed=3)[150][0])
    assert not torch.equal(ds[0][0], ds[1][0])


def test_registry(tmp_path):
    assert set(DATASETS) == set(DATASET_STATS) == set(DEFAULT_AUGMENT)
    assert set(DEFAULT_AUGMENT.values()) <= set(PRESETS)
    for mean, std in DATASET_STATS.values():
        assert len(mean) == len(std) == 3 and all(0 < s < 1 for s in std)
    make_cifar(tmp_path, 100)
    assert build_dataset("cifar100", root=tmp_path, split="test").num_classes == 100
    assert len(build_dataset("digits", split="train")) > 1000
    synthetic = build_dataset("synthetic", split="train", image_size=8, num_samples=5)
    assert synthetic[0][0].shape == (3, 8, 8)
    with pytest.raises(ValueError, match="cifar10"):
        build_dataset("mnist", split="train")


def test_digits_stats_match_data():
    (mean, *_), (std, *_) = DATASET_STATS["digits"]
    x = Digits("train").images.double() / 255
    assert x.mean().item() == pytest.approx(mean, abs=1e-4)
    assert x.std(unbiased=False).item() == pytest.approx(std, abs=1e-4)


# ---------------------------------------------------------------------------------------------
# Transforms


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("train", [True, False])
def test_transform_shapes(preset, train):
    torch.manual_seed(0)
    for size in (16, 32, 40):
        transform = build_transform(preset, size, train)
        for h, w in ((8, 8), (32, 32), (40, 60)):
            image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
            out = transform(image)
            assert out.shape == (3, size, size) and out.dtype == torch.uint8, (size, h, w)


def test_transform_eval_is_deterministic_and_identity_at_native_size():
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    assert torch.equal(build_transform("cifar", 32, False)(image), image)
    assert torch.equal(build_transform("none", 32, False)(image), image)
    eval_imagenet = build_transform("imagenet", 28, False)
    assert torch.equal(eval_imagenet(image), eval_imagenet(image))


def test_digits_preset_does_not_flip():
    # An asymmetric image; any horizontal flip would move mass to the left half.
    image = torch.zeros(3, 8, 8, dtype=torch.uint8)
    image[:, :, 6:] = 255
    transform = build_transform("digits", 8, True)
    for seed in range(20):
        torch.manual_seed(seed)
        out = transform(image).float()
        assert out[:, :, 4:].sum() > out[:, :, :4].sum()


def test_unknown_preset():
    with pytest.raises(ValueError, match="imagenet"):
        build_transform("autoaugment", 32, True)


# ---------------------------------------------------------------------------------------------
# Special files and links in an image folder


def _special_files(folder):
    """Files named like images that are no regular files; name -> what the refusal says."""
    os.mkfifo(folder / "fifo.png")
    os.symlink("/dev/zero", folder / "zero.jpg")
    os.symlink(folder / "nowhere.png", folder / "dangling.jpg")
    os.symlink("fifo.png", folder / "to_fifo.jpg")
    os.mkdir(folder / "folder.png.d")
    os.symlink("folder.png.d", folder / "folder.png")  # a link to a folder: a folder, not a file
    kinds = {"fifo.png": "a FIFO", "zero.jpg": "a character device", "to_fifo.jpg": "a FIFO"}
    kinds["dangling.jpg"] = "No such file or directory"
    return kinds


def test_special_files_named_like_images_are_refused_naming_them_never_read(image_tree):
    root, _ = image_tree
    kinds = _special_files(root / "train" / "cat")
    ds = ImageFolder(root, "train")
    paths = [path for path, _ in ds.samples]
    assert len(ds) == 7 + len(kinds)  # named like images: samples, refused when read
    for name, kind in kinds.items():
        got = within(
            scaled(10), lambda name=name: ds[paths.index(str(root / "train" / "cat" / name))]
        )
        assert isinstance(got, CorruptImageError), got
        assert name in str(got) and kind in str(got), got
    # Skipped under SKIP_CORRUPT, each named, the regular images all read
    dataset = AugmentedDataset(ds, functools.partial(build_transform, "imagenet"), train=True)
    kwargs = dict(batch_size=4, shuffle=False, drop_last=False, num_workers=0, pin_memory=False,
                  persistent_workers=False, prefetch_factor=2, seed=0, image_size=16)  # fmt: skip
    loader = construct_loader(dataset, skip_corrupt=True, **kwargs)
    batches = within(scaled(30), lambda: list(loader))
    assert sum(len(labels) for _, labels, _ in batches) == 7
    reasons = [r for _, _, skipped in batches for r in getattr(skipped, "reasons", ())]
    assert sorted(r.split(str(root / "train" / "cat") + "/")[1].split(":")[0] for r in reasons) == (
        sorted(kinds)
    )


def _links_into_the_folder(root):
    cat, dog = root / "train" / "cat", root / "train" / "dog"
    os.symlink(".", cat / "self")  # two self-links: 2**40 paths for a walk that follows them
    os.symlink(".", cat / "again")
    os.symlink("..", cat / "up")  # the split folder: every class again
    os.symlink("../cat", dog / "twin")  # another class's folder
    os.symlink("../../..", dog / "above")  # a folder holding the split folder
    return 5


def test_links_back_into_the_folder_are_not_followed_and_each_is_named(image_tree, caplog):
    root, _ = image_tree
    clean = ImageFolder(root, "train").samples
    reference = make_dataset(str(root / "train"), {"cat": 0, "dog": 1}, IMG_EXTENSIONS)
    assert clean == reference  # torchvision's order, sample for sample
    links = _links_into_the_folder(root)
    with caplog.at_level(logging.WARNING):
        ds = within(scaled(20), lambda: ImageFolder(root, "train"))
    assert not isinstance(ds, BaseException), ds
    assert ds.samples == clean
    assert caplog.text.count("not entering") == links
    assert "leads back into the image folder" in caplog.text


def test_links_out_of_the_folder_are_followed_once(image_tree, tmp_path, caplog):
    root, _ = image_tree
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for i in range(2):
        Image.fromarray(_rgb(np.random.default_rng(i), 8, 8)).save(outside / f"o{i}.png")
    os.symlink(".", outside / "loop")  # a loop outside the folder
    dog = root / "train" / "dog"
    os.symlink(outside, dog / "more")
    os.symlink(outside, dog / "same_again")  # the same folder through a second link
    with caplog.at_level(logging.WARNING):
        ds = within(scaled(20), lambda: ImageFolder(root, "train"))
    assert not isinstance(ds, BaseException), ds
    assert len(ds) == 7 + 2
    assert sorted(p for p, label in ds.samples if "o" in os.path.basename(p)) == [
        str(dog / "more" / "o0.png"),
        str(dog / "more" / "o1.png"),
    ]
    assert caplog.text.count("not entering") == 2
