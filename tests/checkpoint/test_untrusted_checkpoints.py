"""Checkpoint and weights files handed over by someone else: data, never code (a crafted DCP
``.metadata`` or CIFAR batch runs nothing, through the allowlisting unpickler), a size a header
claims is checked before anything is allocated, and a damaged sharded checkpoint or weights file is
named: a flipped byte, a truncation, a manifest deleted, a dtype that would lose precision."""

import logging
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from pycls.checkpoint import files as integrity
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint import weight_files as weights
from pycls.checkpoint.files import UntrustedCheckpointError
from pycls.checkpoint.single_file import CheckpointError
from pycls.checkpoint.unpickle import UnsafePickleError
from pycls.core import cli
from pycls.datasets import Cifar
from pycls.models import VisionTransformer
from tests.helpers import (
    QUICKSTART,
    TINY,
)

pytestmark = pytest.mark.usefixtures("single_thread")


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _small_model():
    return VisionTransformer(
        image_size=16, patch_size=4, depth=1, width=32, num_heads=2, mlp_dim=32, num_classes=3
    )


def _sharded(tmp_path, epoch=1):
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters())
    return sharded_checkpoint.save_sharded(
        str(tmp_path), epoch, module=model, optimizer=opt, cfg_yaml=""
    )


def test_the_payload_runs_under_plain_pickle(tmp_path):
    """The control: the payload below is real (plain pickle.load would run it)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("with_manifest", [False, True])
def test_crafted_dcp_metadata_executes_nothing(tmp_path, with_manifest):
    folder = _sharded(tmp_path)
    marker = tmp_path / "ran"
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    if with_manifest:  # a crafted folder can carry a matching manifest: not a defence by itself
        integrity.write_manifest(folder)
    else:
        os.remove(os.path.join(folder, integrity.MANIFEST))
    # TEST.WEIGHTS / TRAIN.WEIGHTS, consolidation and auto-resume all read it the same way
    for load in (
        lambda: sharded_checkpoint.load_model_weights(folder, _small_model()),
        lambda: sharded_checkpoint.consolidate(folder),
    ):
        with pytest.raises(UntrustedCheckpointError, match=r"\.metadata: refusing to load posix"):
            load()
    assert not marker.exists()


def test_crafted_cifar_batch_executes_nothing(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "ran"
    good = {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 1]}
    for name in [f"data_batch_{i}" for i in range(1, 6)]:
        entry = {**good, "labels": _Payload(marker)} if name == "data_batch_3" else good
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
    with pytest.raises(UnsafePickleError, match="data_batch_3: refusing to load posix.system"):
        Cifar(tmp_path, "train")
    assert not marker.exists()


def test_a_safetensors_header_claiming_gigabytes_allocates_nothing(tmp_path):
    import resource

    path = tmp_path / "claims.safetensors"
    path.write_bytes((2 << 30).to_bytes(8, "little") + b'{"w": {}}')  # a 2 GB header, claimed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(weights.WeightsError, match="cannot read .* as safetensors"):
        weights.read_state_dict(str(path))
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 100_000


def test_sharded_checkpoint_flipped_byte_and_truncation_are_named(tmp_path):
    folder = _sharded(tmp_path)
    shard = os.path.join(folder, "__0_0.distcp")
    original = Path(shard).read_bytes()
    for offset in (0, len(original) // 3, len(original) - 1):  # header, tensor data, trailer
        data = bytearray(original)
        data[offset] ^= 0xFF
        Path(shard).write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupt: .* CRC32"):
            sharded_checkpoint.load_model_weights(folder, _small_model())
    Path(shard).write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is \d+ bytes, \d+ were written"):
        sharded_checkpoint.load_model_weights(folder, _small_model())
    # Without a manifest (an older pycls's folder, loaded unverified on request) the metadata's
    # claims are still checked against the files: the truncation is named
    _as_older_pycls(folder)
    with pytest.raises(CheckpointError, match=f"checkpoint {folder}: item .* of __0_0.distcp, wh"):
        sharded_checkpoint.load_model_weights(folder, _small_model(), allow_unverified=True)
    Path(shard).write_bytes(original)  # restored: loads again
    state = sharded_checkpoint.load_model_weights(folder, _small_model(), allow_unverified=True)
    assert state["epoch"] == 1


def _as_older_pycls(folder):
    """The folder as a pycls without manifests wrote it: no manifest, no mention of one."""
    os.remove(os.path.join(folder, integrity.MANIFEST))
    path = os.path.join(folder, sharded_checkpoint.TRAIN_STATE)
    state = checkpoint.load_file(path)
    del state["manifest"]
    checkpoint.save_file(state, path)


def test_deleting_the_manifest_does_not_switch_verification_off(tmp_path, caplog):
    folder = _sharded(tmp_path)
    shard = Path(folder) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.remove(os.path.join(folder, integrity.MANIFEST))
    for allow in (False, True):  # a folder pycls sealed is refused without its manifest
        with pytest.raises(CheckpointError, match="manifest.json is missing, but pycls sealed"):
            sharded_checkpoint.load_model_weights(folder, _small_model(), allow_unverified=allow)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        sharded_checkpoint.read_state(folder)  # what auto-resume reads
    # Another program's DCP folder (no train state): only on request, and said to be unverified
    model = _small_model()
    foreign = str(tmp_path / "foreign")
    torch.distributed.checkpoint.save({"model": model.state_dict()}, checkpoint_id=foreign,
                                      no_dist=True)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"no manifest.json \(not written by pycls\).*"
                       "ALLOW_UNVERIFIED_CHECKPOINTS True"):  # fmt: skip
        sharded_checkpoint.load_model_weights(foreign, _small_model())
    loaded = _small_model()
    with caplog.at_level(logging.WARNING):
        sharded_checkpoint.load_model_weights(foreign, loaded, allow_unverified=True)
    assert "no manifest.json (not written by pycls); loaded UNVERIFIED" in caplog.text
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    # An older pycls's folder likewise
    older = _sharded(tmp_path / "older")
    _as_older_pycls(older)
    with pytest.raises(CheckpointError, match=r"\(written by an older pycls\)"):
        sharded_checkpoint.load_model_weights(older, _small_model())
    assert sharded_checkpoint.load_model_weights(older, _small_model(), True)["epoch"] == 1


def test_weights_file_errors_are_one_line_naming_the_key_the_user_gave(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    base = ["--cfg", QUICKSTART, *TINY, "OUT_DIR", str(tmp_path / "run")]
    for mode, key in (("test", "TEST.WEIGHTS"), ("train", "TRAIN.WEIGHTS")):
        assert cli.main(["--mode", mode, *base, key, str(bad)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: {key}: cannot read {bad} as safetensors: ")


def test_weights_of_another_dtype_are_converted_if_lossless_and_logged_else_refused(
    tmp_path, caplog
):
    model = _small_model()
    state = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    half = tmp_path / "half.safetensors"
    weights.save_safetensors(state, str(half))
    loaded = _small_model()
    with caplog.at_level(logging.INFO):
        weights.load_weights(str(half), loaded, naming="pycls")
    assert f"{half}: {len(state)} tensors converted from torch.float16 to torch.float32" in (
        caplog.text
    )
    assert all(torch.equal(loaded.state_dict()[k].half(), v) for k, v in state.items())
    wide = tmp_path / "double.safetensors"
    weights.save_safetensors({k: v.double() for k, v in model.state_dict().items()}, str(wide))
    with pytest.raises(weights.WeightsError, match="dtypes that would lose precision: .*float64"):
        weights.load_weights(str(wide), _small_model(), naming="pycls", key="TEST.WEIGHTS")
