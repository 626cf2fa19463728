"""Files handed over by someone else: each is data, never code, and a size it claims is checked
against the file before anything is allocated. Every test crafts a class of files (several
entries, several special files), not one case."""

import dataclasses
import logging
import os
import pickle
import re
import resource
import shutil
import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from pycls import config
from pycls.checkpoint import files, resume, single_file, weight_files
from pycls.checkpoint import sharded as sharded_checkpoint
from pycls.checkpoint.files import CheckpointError, UntrustedCheckpointError
from pycls.core import builders, exports, resume_checks
from pycls.models import VisionTransformer
from pycls.models.cnn import upstream_weights
from tests.helpers import scaled, tiny_quickstart, tiny_vit, within

pytestmark = pytest.mark.usefixtures("single_thread")


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _small_model():
    torch.manual_seed(0)
    return VisionTransformer(
        image_size=16, patch_size=4, depth=1, width=32, num_heads=2, mlp_dim=32, num_classes=3
    )


def _optimizer(model):
    return torch.optim.AdamW(model.parameters())


# ------------------------------------------------------------------------------------------------ #
# Sharded (DCP) folders: non-tensor items are data too
# ------------------------------------------------------------------------------------------------ #


def _crafted_folder(out, monkeypatch, where, payload):
    """A sharded checkpoint as pycls writes it (sealed with a valid manifest), whose DCP files
    carry ``payload`` in place of the entry ``where`` picks from the saved state."""
    real = sharded_checkpoint.get_state_dict

    def crafted(module, optimizer, options):
        model_state, optim_state = real(module, optimizer, options=options)
        state = {"model": model_state, "optimizer": optim_state}
        part, key = where(state)
        state[part][key] = payload
        return state["model"], state["optimizer"]

    with monkeypatch.context() as m:
        m.setattr(sharded_checkpoint, "get_state_dict", crafted)
        model = _small_model()
        return sharded_checkpoint.save_sharded(
            str(out), 1, module=model, optimizer=_optimizer(model), cfg_yaml=""
        )


def _group_value(state):  # a hyperparameter of an optimizer group (a float saved as bytes)
    return "optimizer", next(k for k in state["optimizer"] if k.endswith(".lr"))


def _group_name(state):  # a string saved as bytes
    return "optimizer", next(k for k in state["optimizer"] if k.endswith(".betas"))


def _moment(state):  # an optimizer tensor replaced by an object
    return "optimizer", next(k for k in state["optimizer"] if k.endswith(".exp_avg"))


def _weight(state):  # a model tensor replaced by an object
    return "model", "pos_embed"


@pytest.mark.parametrize("where", [_group_value, _group_name, _moment, _weight])
def test_an_object_in_a_sealed_dcp_folder_executes_nothing(tmp_path, monkeypatch, where):
    marker = tmp_path / "ran"
    folder = _crafted_folder(tmp_path, monkeypatch, where, _Payload(marker))
    assert files.verify(folder)  # sealed: the manifest is no defence by itself
    state = sharded_checkpoint.read_state(folder)  # what auto-resume reads first

    def restore():  # auto-resume: model and optimizer
        model = _small_model()
        sharded_checkpoint.restore_sharded(folder, state, model, _optimizer(model))

    loads = [
        restore,
        lambda: sharded_checkpoint.load_model_weights(folder, _small_model()),  # *.WEIGHTS
        lambda: sharded_checkpoint.consolidate(folder),
    ]
    for load in loads:
        try:
            load()
        except UntrustedCheckpointError as e:
            assert "refusing to load posix.system" in str(e) and folder in str(e)
        except CheckpointError as e:  # read only as a tensor: refused as not fitting
            assert where in (_moment, _weight) and folder in str(e), e
    assert not marker.exists()


@pytest.mark.parametrize("where", [_moment, _weight])
def test_a_plain_value_where_a_tensor_belongs_is_refused_naming_the_item(
    tmp_path, monkeypatch, where
):
    folder = _crafted_folder(tmp_path, monkeypatch, where, 7)
    state = sharded_checkpoint.read_state(folder)
    model = _small_model()
    with pytest.raises(CheckpointError, match=r"item .* holds a int, not a tensor"):
        sharded_checkpoint.restore_sharded(folder, state, model, _optimizer(model))


def _sealed(tmp_path):
    model = _small_model()
    return sharded_checkpoint.save_sharded(
        str(tmp_path), 1, module=model, optimizer=_optimizer(model), cfg_yaml=""
    )


def _edit_metadata(folder, edit):
    """Rewrites the folder's .metadata through ``edit`` and seals it again (a valid manifest)."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    edit(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    files.write_manifest(folder)


def _tensor(metadata, name="model.pos_embed"):
    return metadata.state_dict_metadata[name]


def _huge_tensor(metadata):  # 2**40 elements claimed, in one chunk of the same size
    meta = _tensor(metadata)
    index = next(i for i in metadata.storage_data if i.fqn == "model.pos_embed")
    info = metadata.storage_data.pop(index)
    meta.size = torch.Size([1, 2**20, 2**20])
    meta.chunks[0].sizes = meta.size
    metadata.storage_data[MetadataIndex("model.pos_embed", [0, 0, 0])] = info


def _uncovered_tensor(metadata):  # 2**40 elements claimed, the stored chunk left as it was
    _tensor(metadata).size = torch.Size([1, 2**20, 2**20])


def _item_past_the_end(metadata):
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(info, length=info.length + 2**40)


def _item_outside_the_folder(metadata):
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../../etc/passwd")


def _chunk_outside_the_tensor(metadata):
    meta = _tensor(metadata)
    meta.chunks[0].offsets = torch.Size([0, 2**30, 0])


@pytest.mark.parametrize(
    "edit, match",
    [
        (_huge_tensor, r"claims 1099511627776 elements \(4398046511104 bytes\) in a chunk of"),
        (_uncovered_tensor, r"claims 1099511627776 elements, its chunks hold"),
        (_item_past_the_end, r"claims bytes \d+\.\.\d+ of __0_0.distcp, which has \d+"),
        (_item_outside_the_folder, r"names a file outside the folder: '../../etc/passwd'"),
        (_chunk_outside_the_tensor, r"pos_embed: a chunk .* has no place or no data"),
    ],
)
def test_sizes_a_dcp_folder_claims_are_checked_before_anything_is_allocated(tmp_path, edit, match):
    folder = _sealed(tmp_path)
    _edit_metadata(folder, edit)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loads = [
        lambda: sharded_checkpoint.read_state(folder),  # auto-resume's first read
        lambda: sharded_checkpoint.load_model_weights(folder, _small_model()),
        lambda: sharded_checkpoint.consolidate(folder),
        lambda: sharded_checkpoint.read_model_state(folder),
    ]
    for load in loads:
        with pytest.raises(CheckpointError, match=match):
            load()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB


def test_a_clean_folder_restores_model_and_optimizer_exactly(tmp_path):
    """The control: the vetted reader loads what pycls writes, every group value included."""
    model = _small_model()
    optimizer = _optimizer(model)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    folder = sharded_checkpoint.save_sharded(
        str(tmp_path), 1, module=model, optimizer=optimizer, cfg_yaml=""
    )
    loaded = VisionTransformer(
        image_size=16, patch_size=4, depth=1, width=32, num_heads=2, mlp_dim=32, num_classes=3
    )
    fresh = torch.optim.AdamW(loaded.parameters(), lr=0.5, betas=(0.1, 0.2))
    state = sharded_checkpoint.read_state(folder)
    sharded_checkpoint.restore_sharded(folder, state, loaded, fresh)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    saved, got = optimizer.state_dict(), fresh.state_dict()
    assert saved["param_groups"] == got["param_groups"]
    for i, moments in saved["state"].items():
        for name, value in moments.items():
            assert torch.equal(got["state"][i][name], value), (i, name)


# ------------------------------------------------------------------------------------------------ #
# A stored config claims a model: checked against the weights before it is built
# ------------------------------------------------------------------------------------------------ #

# 12 blocks 2048 wide: 600 M parameters (2.4 GB in fp32) claimed by a file of a few KB
_HUGE_VIT = ["VIT.DEPTH", "12", "VIT.WIDTH", "2048", "VIT.NUM_HEADS", "16", "VIT.MLP_DIM", "8192"]
_DEEP_VIT = ["VIT.DEPTH", "100000000"]  # 10**8 blocks: even their empty modules would not fit
_HUGE_CNN = ["MODEL.TYPE", "regnet", "REGNET.DEPTH", "40", "REGNET.W0", "2048", "REGNET.WA", "512",
             "REGNET.WM", "2.0", "REGNET.GROUP_W", "64"]  # fmt: skip


def _tiny_weights_claiming(tmp_path, kind, claim):
    """A file (or folder) holding a tiny ViT's weights and a stored config claiming ``claim``."""
    cfg_yaml = tiny_quickstart(tmp_path / "claim", *claim).dump()
    model = tiny_vit()
    if kind == "safetensors":
        path = str(tmp_path / "model_final.safetensors")
        return weight_files.save_safetensors(
            model.state_dict(), path, {"naming": "pycls", "cfg": cfg_yaml}
        )
    if kind == "pyth":
        state = {"model_state": model.state_dict(), "cfg": cfg_yaml, "epoch": 1}
        return single_file.save_file(state, str(tmp_path / "model_epoch_0001.pyth"))
    return sharded_checkpoint.save_sharded(
        str(tmp_path), 1, module=model, optimizer=_optimizer(model), cfg_yaml=cfg_yaml
    )


@pytest.mark.parametrize("claim", [_HUGE_VIT, _DEEP_VIT, _HUGE_CNN], ids=["wide", "deep", "cnn"])
@pytest.mark.parametrize("kind", ["safetensors", "pyth", "sharded"])
def test_a_stored_config_is_checked_against_the_weights_before_a_model_is_built(
    tmp_path, kind, claim
):
    path = _tiny_weights_claiming(tmp_path, kind, claim)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with pytest.raises(weight_files.WeightsError, match=r"its stored config describes .* holds"):
        exports.export_checkpoint(path, "safetensors", str(tmp_path / "out.safetensors"))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB
    assert time.perf_counter() - started < scaled(30)
    assert not os.path.exists(tmp_path / "out.safetensors")


def test_a_stored_config_that_fits_its_weights_still_exports(tmp_path):
    """The control: the tiny ViT's own config passes the check."""
    cfg = tiny_quickstart(tmp_path / "own", "VIT.DEPTH", "2", "VIT.MLP_DIM", "64")
    model = builders.build_model(cfg)
    path = single_file.save_file(
        {"model_state": model.state_dict(), "cfg": cfg.dump(), "epoch": 1},
        str(tmp_path / "model_epoch_0001.pyth"),
    )
    out = exports.export_checkpoint(path, "safetensors", str(tmp_path / "out.safetensors"))
    back = weight_files.read_state_dict(out)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------------ #
# Special files named like checkpoints are never opened for reading
# ------------------------------------------------------------------------------------------------ #


def test_special_files_named_like_checkpoints_are_passed_over_by_auto_resume(tmp_path, caplog):
    out = str(tmp_path)
    model = tiny_vit()
    good = single_file.save_checkpoint(
        out, 1, model=model, optimizer=_optimizer(model), cfg_yaml=""
    )
    ckpt_dir = single_file.get_checkpoint_dir(out)
    os.mkfifo(single_file.get_checkpoint_path(out, 9))  # the newest epoch, as a FIFO
    os.symlink("/dev/zero", single_file.get_checkpoint_path(out, 8))
    os.symlink("nowhere", single_file.get_checkpoint_path(out, 7))
    os.mkfifo(os.path.join(ckpt_dir, "model_epoch_0006_iter_000003.pyth"))
    # a folder whose DCP metadata is a FIFO (sealed by hand: its manifest cannot read a FIFO)
    folder = _sealed(tmp_path / "five")
    os.remove(os.path.join(folder, ".metadata"))
    os.mkfifo(os.path.join(folder, ".metadata"))
    shutil.move(folder, single_file.get_checkpoint_path(out, 5, sharded=True))
    with caplog.at_level(logging.WARNING):
        found = within(scaled(20), lambda: resume.find_resumable(out))
    assert not isinstance(found, BaseException), found
    assert found[0] == good and found[1]["epoch"] == 1
    assert caplog.text.count("is named like a checkpoint but is no regular file") == 4
    assert "model_epoch_0005" in caplog.text  # the folder: refused and set aside, named
    assert single_file.get_last_checkpoint(out) == good


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_weights_given_as_a_special_file_are_refused_without_reading(tmp_path, special):
    path = str(tmp_path / "weights.pyth")
    if special == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    for load in (
        lambda: sharded_checkpoint.load_model_weights(path, tiny_vit()),  # TEST.WEIGHTS
        lambda: weight_files.read_state_dict(path),  # TRAIN.WEIGHTS
        lambda: exports.export_checkpoint(path, "safetensors"),
    ):
        got = within(scaled(10), load)
        assert isinstance(got, (CheckpointError, weight_files.WeightsError)), got
        assert "regular file" in str(got) or "not a file" in str(got), got
    assert not upstream_weights.is_upstream_checkpoint_file(path)  # --mode test's fallback


# ------------------------------------------------------------------------------------------------ #
# A config stored in a checkpoint is bounded like a config file
# ------------------------------------------------------------------------------------------------ #


def _mapping_bomb(levels=9, fan=9):
    """A stored config of a few hundred bytes whose nested mapping aliases name ``fan ** levels``
    sections: yacs copies each into a node of its own."""
    lines = ["L0: &l0 {A: 0, B: 0}"]
    for i in range(1, levels):
        lines.append(f"L{i}: &l{i} {{{', '.join(f'K{j}: *l{i - 1}' for j in range(fan))}}}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("reader", ["auto-resume", "export"])
def test_a_stored_config_that_expands_without_end_is_refused_before_it_is_built(tmp_path, reader):
    model = tiny_vit()
    path = single_file.save_file(
        {"model_state": model.state_dict(), "cfg": _mapping_bomb(), "epoch": 1},
        single_file.get_checkpoint_path(str(tmp_path), 1),
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if reader == "auto-resume":  # compares the stored config with the current one
        state = single_file.load_file(path)
        cfg = tiny_quickstart(tmp_path)
        got = within(scaled(20), lambda: resume_checks.check_compatible(path, state, cfg))
        assert isinstance(got, CheckpointError), got
        assert re.search(r"its stored config: the value at line \d+ expands to more", str(got))
    else:
        with pytest.raises(config.ConfigError, match=r"a stored config: the value at line \d+"):
            exports.export_checkpoint(path, "safetensors", str(tmp_path / "out.safetensors"))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB
