"""No silent wrong result: a run that cannot do what its config says stops, in one line naming
why, instead of finishing with exit 0 and a model that is not what was asked for.

- a DATA.PATH that is not there, given to a config whose data sets read no folder;
- float16 loss scaling: a skipped step leaves no trace in batch-norm statistics, and a run whose
  every step is skipped has diverged (exit 3, as in fp32);
- an epoch (or a test split) whose every sample was skipped as corrupt trained (evaluated)
  nothing.
"""

import os

import pytest
import torch

from pycls import config
from pycls.core import cli
from pycls.core.trainer import MAX_CONSECUTIVE_SKIPS, Trainer
from pycls.errors import DivergedError
from tests.helpers import QUICKSTART, TINY

CNN = [
    "MODEL.TYPE", "anynet", "ANYNET.STEM_TYPE", "res_stem_cifar", "ANYNET.STEM_W", "8",
    "ANYNET.BLOCK_TYPE", "res_bottleneck_block", "ANYNET.DEPTHS", "[1]", "ANYNET.WIDTHS", "[8]",
    "ANYNET.STRIDES", "[1]", "ANYNET.BOT_MULS", "[1.0]", "ANYNET.GROUP_WS", "[8]",
]  # fmt: skip


def _fp16_works_here():
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.nn.Conv2d(3, 4, 3)(torch.randn(1, 3, 8, 8)).sum().float().backward()
        return True
    except RuntimeError:
        return False


needs_fp16 = pytest.mark.skipif(not _fp16_works_here(), reason="no float16 autocast on this CPU")


@pytest.mark.parametrize("path_kind", ["missing", "not_a_folder_of_classes"])
def test_a_data_path_the_config_would_ignore_is_refused(capsys, tmp_path, path_kind):
    path = tmp_path / "data"
    if path_kind == "not_a_folder_of_classes":
        path.mkdir()
        (path / "train.txt").write_text("not images")
    opts = [*TINY, "DATA.PATH", str(path), "OUT_DIR", str(tmp_path / "out")]
    assert cli.main(["--mode", "train", "--cfg", QUICKSTART, *opts]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"config error: DATA.PATH: {path} ") and "digits" in line
    assert not (tmp_path / "out").exists()


def _trainer(tmp_path, *overrides):
    cfg = config.load_cfg(
        QUICKSTART,
        [
            *TINY, *CNN, "OUT_DIR", str(tmp_path), "AMP.LEVEL", "O1", "AMP.DTYPE", "float16",
            "TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic", "TRAIN.IM_SIZE", "16",
            "TEST.IM_SIZE", "16", "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4",
            "LOG_PERIOD", "4", "DATA_LOADER.NUM_WORKERS", "0", *overrides,
        ],
    )  # fmt: skip
    return Trainer(cfg, torch.device("cpu"))


class _Poisoned:
    """Cross-entropy, with the logits of the calls in ``at`` turned to ``value`` (a batch whose
    forward pass overflowed or held NaN; its batch-norm layers have seen it)."""

    def __init__(self, value, at):
        self.value, self.at, self.calls = value, at, 0

    def __call__(self, logits, targets):
        self.calls += 1
        if self.at is None or self.calls in self.at:
            logits = logits * self.value
        return torch.nn.functional.cross_entropy(logits, targets)


def _bn_stats(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


@needs_fp16
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skipped_float16_step_leaves_the_batch_norm_statistics_as_they_were(
    tmp_path, value, level
):
    t = _trainer(tmp_path, "AMP.LEVEL", level)
    batches = iter(t.train_batches)
    t.train_loader.sampler.set_epoch(0)
    t.engine.train()
    t.step(batches, 1e-3)  # a clean step
    before = _bn_stats(t.engine.module)
    images, labels, skipped = next(batches)
    poisoned = iter([(images * value, labels, skipped)])  # NaN / inf pixels: BN sees them
    t.step(poisoned, 1e-3)
    assert t.scaler.skipped_steps == 1
    after = _bn_stats(t.engine.module)
    assert before and all(torch.equal(before[k], after[k]) for k in before)
    t.step(batches, 1e-3)  # and training goes on with finite statistics
    assert all(torch.isfinite(v).all() for v in _bn_stats(t.engine.module).values())


@needs_fp16
def test_a_float16_run_whose_every_step_is_skipped_has_diverged(tmp_path):
    t = _trainer(tmp_path, "OPTIM.MAX_EPOCH", "10")
    t.loss_fn = _Poisoned(float("inf"), at=None)  # every gradient overflows
    epochs = -(-(MAX_CONSECUTIVE_SKIPS + 4) // len(t.train_loader))  # the count runs on
    with pytest.raises(DivergedError, match=r"skipped the last \d+ steps .* diverged"):
        for epoch in range(epochs):
            t.train_epoch(epoch)
    assert t.scaler.consecutive_skips >= MAX_CONSECUTIVE_SKIPS


@needs_fp16
def test_a_few_skipped_float16_steps_are_not_divergence(tmp_path):
    t = _trainer(tmp_path)
    t.loss_fn = _Poisoned(float("inf"), at={2, 3, 5})
    stats = t.train_epoch(0)  # three overflowing steps skipped, the run goes on
    assert stats["skipped_steps"] == 3 and t.scaler.consecutive_skips == 0
    assert all(torch.isfinite(p).all() for p in t.engine.module.parameters())


def _all_corrupt_folder(root, corrupt_splits=("train", "val")):
    from PIL import Image

    for split in ("train", "val"):
        for name in ("a", "b"):
            os.makedirs(root / split / name)
            for i in range(4):
                path = root / split / name / f"{i}.jpg"
                if split in corrupt_splits:
                    path.write_bytes(b"\xff\xd8 not a jpeg")
                else:
                    Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(path)
    return root


@pytest.mark.parametrize("which", ["train", "val"])
def test_a_split_whose_every_sample_is_corrupt_is_refused(tmp_path, capsys, which):
    data = _all_corrupt_folder(tmp_path / "data", corrupt_splits=(which,))
    out = tmp_path / "out"
    run = ["--mode", "train", "--cfg", QUICKSTART, *TINY]
    run += ["DATA.PATH", str(data), "DATA_LOADER.SKIP_CORRUPT", "True", "OUT_DIR", str(out)]
    run += ["TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "2"]
    run += ["MODEL.NUM_CLASSES", "2", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]
    run += ["VIT.PATCH_SIZE", "4", "DATA_LOADER.NUM_WORKERS", "0"]
    assert cli.main(run) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "was skipped as corrupt" in lines[0] and "skipped_files.txt" in lines[0]
    assert not (out / "model_final.safetensors").exists()
    assert not (out / "checkpoints" / "model_best.pyth").exists()


@pytest.mark.parametrize(
    "field, value",
    [
        ("format", "jpeg"),  # raw pixels read as JPEG: every sample "corrupt"
        ("format", "png"),
        ("image_size", 0),
        ("image_size", "8"),
        ("shards", ["../../elsewhere.bin"]),
        ("shards", ["/etc/passwd"]),
    ],
)
def test_an_edited_shard_index_is_refused_at_open(tmp_path, field, value):
    """An index.json whose reading instructions were edited would make every sample unreadable
    (or read other files): refused when the split opens, naming the index and the field."""
    import json

    from pycls.checkpoint.files import CorruptFileError
    from pycls.datasets.formats.digits import Digits
    from pycls.datasets.formats.prepared_shard_writer import prepare_split
    from pycls.datasets.formats.prepared_shards import ShardDataset

    folder = tmp_path / "shards" / "train"
    source = torch.utils.data.Subset(Digits("train"), range(20))
    prepare_split(source, folder, dataset="digits", split="train", shard_size=10)
    ShardDataset(folder.parent, "train")  # as prepared: opens
    index = folder / "index.json"
    info = json.loads(index.read_text())
    info[field] = value
    index.write_text(json.dumps(info))
    with pytest.raises(CorruptFileError, match=rf"shard index {index} is unreadable.*{field}"):
        ShardDataset(folder.parent, "train")
    del info["fields_crc32"]  # as an older pycls wrote it: what each field can hold is checked
    index.write_text(json.dumps(info))
    if (field, value) == ("format", "jpeg"):
        return  # a valid value: only the checksum could tell
    with pytest.raises(CorruptFileError, match=rf"shard index {index} is unreadable.*{field}"):
        ShardDataset(folder.parent, "train")
