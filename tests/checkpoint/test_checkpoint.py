"""Checkpoint files: atomic writes, checksums, clear errors, weights-only loading."""

import os
from pathlib import Path

import pytest
import torch

from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint.single_file import CheckpointError
from pycls.models import VisionTransformer


def _tiny(image_size=16):
    return VisionTransformer(
        image_size=image_size,
        patch_size=4,
        depth=1,
        width=16,
        num_heads=2,
        mlp_dim=32,
        num_classes=3,
    )


def _save(tmp_path, model=None):
    model = model or _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    opt.step()
    path = checkpoint.save_checkpoint(
        str(tmp_path), 3, model=model, optimizer=opt, cfg_yaml="A: 1\n"
    )
    return path, model, opt


def test_round_trip_and_plain_torch_load(tmp_path):
    path, model, opt = _save(tmp_path)
    assert path == checkpoint.get_checkpoint_path(str(tmp_path), 3)
    assert checkpoint.get_last_checkpoint(str(tmp_path)) == path
    raw = torch.load(path, weights_only=True)  # the default since torch 2.6: plain types only
    assert raw["epoch"] == 3 and raw["cfg"] == "A: 1\n"
    other = _tiny()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    state = checkpoint.load_checkpoint(path, model=other, optimizer=other_opt, restore_rng=False)
    assert state["epoch"] == 3
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert other_opt.state_dict()["state"][0]["momentum_buffer"].equal(
        opt.state_dict()["state"][0]["momentum_buffer"]
    )
    assert [f for f in os.listdir(os.path.dirname(path)) if ".tmp." in f] == []


def test_truncated_checkpoint_is_an_error(tmp_path):
    path, _, _ = _save(tmp_path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot be read") as e:
        checkpoint.load_file(path)
    assert path in str(e.value)


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
    path, _, _ = _save(tmp_path)
    data = bytearray(Path(path).read_bytes())
    # The middle of the file lies in tensor data, which torch's zip reader does not verify
    middle = len(data) // 2
    data[middle] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_file(path)
    assert path in str(e.value)


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load_file(str(tmp_path / "nope.pyth"))
    foreign = tmp_path / "foreign.pyth"
    torch.save({"w": torch.ones(2)}, foreign)
    with pytest.raises(CheckpointError, match="not a pycls checkpoint"):
        checkpoint.load_file(str(foreign))


def test_crash_while_saving_keeps_the_previous_file(tmp_path, monkeypatch):
    path, model, opt = _save(tmp_path)
    before = Path(path).read_bytes()

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    # One error naming the file and the cause (pycls.checkpoint.files)
    with pytest.raises(CheckpointError, match="model_epoch_0003.pyth: OSError: disk full"):
        checkpoint.save_checkpoint(str(tmp_path), 3, model=model, optimizer=opt, cfg_yaml="")
    assert Path(path).read_bytes() == before
    assert [f for f in os.listdir(os.path.dirname(path)) if ".tmp." in f] == []


def test_weights_that_do_not_fit_name_the_file(tmp_path):
    path, _, _ = _save(tmp_path)
    wider = VisionTransformer(
        image_size=16, patch_size=4, depth=1, width=32, num_heads=2, mlp_dim=32, num_classes=3
    )
    with pytest.raises(CheckpointError, match="does not fit") as e:
        checkpoint.load_model_weights(path, wider)
    assert path in str(e.value)


def test_weights_from_another_image_size_load(tmp_path):
    path, model, _ = _save(tmp_path)
    bigger = _tiny(image_size=32)
    checkpoint.load_model_weights(path, bigger)
    assert bigger.pos_embed.shape[1] == 1 + 64  # class token + 8x8 grid
    assert torch.equal(bigger.head.weight, model.head.weight)
    assert bigger(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def test_rng_state_round_trip():
    state = checkpoint.capture_rng_state()
    a = (torch.rand(3), __import__("numpy").random.rand(3), __import__("random").random())
    checkpoint.restore_rng_state(state)
    b = (torch.rand(3), __import__("numpy").random.rand(3), __import__("random").random())
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and a[2] == b[2]


def test_prune_keeps_the_newest_epoch_checkpoints_and_the_best(tmp_path):
    from pycls.checkpoint import resume

    d = Path(checkpoint.get_checkpoint_dir(str(tmp_path)))
    d.mkdir()
    for name in ("model_epoch_0001.pyth", "model_epoch_0002_iter_000010.pyth", "model_best.pyth"):
        (d / name).write_bytes(b"x")
    (d / "model_epoch_0002").mkdir()  # a sharded checkpoint folder
    (d / "model_epoch_0002" / "train_state.pyth").write_bytes(b"x")
    (d / "model_epoch_0003.pyth").write_bytes(b"x")
    assert resume.prune_checkpoints(str(tmp_path), 0) == []
    removed = resume.prune_checkpoints(str(tmp_path), 2)
    assert sorted(os.path.basename(p) for p in removed) == [
        "model_epoch_0001.pyth",
        "model_epoch_0002",
    ]
    assert sorted(os.listdir(d)) == [
        "model_best.pyth",
        "model_epoch_0002_iter_000010.pyth",
        "model_epoch_0003.pyth",
    ]


@pytest.mark.slow
def test_training_keeps_the_last_n_checkpoints_and_resumes_from_them(tmp_path):
    from pycls.core import trainer
    from tests.helpers import tiny_quickstart

    keep = ["TRAIN.KEEP_CHECKPOINTS", "2", "TRAIN.CHECKPOINT_PERIOD", "1", "TRAIN.EVAL_PERIOD", "1"]
    trainer.train_model(tiny_quickstart(tmp_path, *keep, "OPTIM.MAX_EPOCH", "4"))
    d = checkpoint.get_checkpoint_dir(str(tmp_path))
    expected = ["model_best.pyth", "model_epoch_0003.pyth", "model_epoch_0004.pyth"]
    assert sorted(os.listdir(d)) == expected
    assert os.path.isfile(tmp_path / "model_final.safetensors")
    trainer.train_model(tiny_quickstart(tmp_path, *keep, "OPTIM.MAX_EPOCH", "5"))  # resumes at 4
    expected = ["model_best.pyth", "model_epoch_0004.pyth", "model_epoch_0005.pyth"]
    assert sorted(os.listdir(d)) == expected


@pytest.mark.parametrize("kind", ["ema", "raw"])
def test_the_best_checkpoint_holds_the_weights_it_names(tmp_path, monkeypatch, kind):
    """model_best.pyth's "weights" names the EMA's or the raw weights: it holds those, as the
    checkpoint of its epoch keeps them (the evaluation picks; here the pick is forced). Caught:
    the state dict taken inside the EMA's swap held the parameters themselves, raw again once
    written (a model_best of the raw weights named "ema")."""
    from pycls.core import trainer
    from tests.helpers import tiny_quickstart

    def note_best(self, epoch, raw_stats, ema_stats):
        self.best = {"top1_err": raw_stats["top1_err"], "epoch": epoch + 1, "weights": kind}
        self._best_due = True

    monkeypatch.setattr(trainer.Trainer, "_note_best", note_best)
    every = ["TRAIN.CHECKPOINT_PERIOD", "1", "TRAIN.EVAL_PERIOD", "1", "OPTIM.MAX_EPOCH", "1"]
    ema = ["TRAIN.EMA", "True", "TRAIN.EMA_DECAY", "0.9"]
    trainer.train_model(tiny_quickstart(tmp_path, *every, *ema))
    best = checkpoint.load_file(checkpoint.get_best_checkpoint_path(str(tmp_path)))
    last = checkpoint.load_file(checkpoint.get_checkpoint_path(str(tmp_path), 1))
    assert best["weights"] == kind and best["epoch"] == 1
    averaged, raw = last["ema_state"]["tensors"], last["model_state"]
    assert any(not torch.equal(averaged[k], raw[k]) for k in raw)  # two sets of weights here
    expected = averaged if kind == "ema" else raw
    for k, v in expected.items():
        assert torch.equal(best["model_state"][k], v), k
