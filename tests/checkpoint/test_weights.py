"""Weights files: every format into TRAIN.WEIGHTS, adapted heads and tables, errors, export."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from torch import nn

from pycls import config, errors
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint import weight_files as weights_files
from pycls.checkpoint.files import CheckpointWriteError
from pycls.core import exports
from pycls.models import VisionTransformer, convert, resample_pos_embed
from pycls.models.vit import from_timm
from tests.helpers import ROOT, tiny_quickstart

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

ARGS = dict(image_size=16, patch_size=4, depth=2, width=32, num_heads=2, mlp_dim=64)


@torch.no_grad()
def random_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    model = VisionTransformer(**{**ARGS, "num_classes": 10, **kwargs})
    for p in model.parameters():
        p.add_(0.1 * torch.randn_like(p))  # the head is zero-initialised
    return model.eval()


def same_weights(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return all(torch.equal(sa[k], sb[k]) for k in sa if k not in skip)


def write(state, path):
    if str(path).endswith(".safetensors"):
        weights_files.save_safetensors(state, str(path))
    else:
        torch.save(state, path)
    return str(path)


@pytest.mark.parametrize(
    "naming, name",
    [
        ("pycls", "w.safetensors"),
        ("pycls", "w.pth"),
        ("timm", "w.safetensors"),
        ("timm", "w.pth"),
        ("torchvision", "w.pth"),
    ],
)
def test_every_format_loads_exactly(tmp_path, naming, name):
    source = random_model(classifier="token")
    path = write(convert.from_pycls(source, naming), tmp_path / name)
    for fmt in ("auto", naming):
        target = VisionTransformer(**ARGS, num_classes=10, classifier="token")
        weights_files.load_weights(path, target, fmt)
        assert same_weights(source, target)


def test_pycls_checkpoint_and_nested_and_ddp_prefixed_state_dicts(tmp_path):
    source = random_model()
    state = source.state_dict()
    ckpt = checkpoint.save_file({"model_state": state, "cfg": ""}, str(tmp_path / "c.pyth"))
    nested = write({"model": state, "epoch": 3}, tmp_path / "n.pth")
    ddp = write({f"module.{k}": v for k, v in state.items()}, tmp_path / "d.pth")
    for path in (ckpt, nested, ddp):
        target = VisionTransformer(**ARGS, num_classes=10)
        weights_files.load_weights(path, target)
        assert same_weights(source, target), path


def test_head_for_other_classes_is_dropped_and_reinitialised(tmp_path):
    source = random_model()
    path = write(source.state_dict(), tmp_path / "w.safetensors")
    target = VisionTransformer(**ARGS, num_classes=5, head_init_scale=0.0)
    weights_files.load_weights(path, target)
    assert not target.head.weight.any() and not target.head.bias.any()
    src, tgt = source.state_dict(), target.state_dict()
    assert all(torch.equal(src[k], tgt[k]) for k in tgt if not k.startswith("head."))
    # Evaluation keeps the trained head: there another class count is an error
    with pytest.raises(weights_files.WeightsError, match="head.weight"):
        weights_files.load_weights(path, VisionTransformer(**ARGS, num_classes=5), new_head=False)


@pytest.mark.parametrize("classifier", ["token", "pooled"])
def test_position_embedding_is_resampled_for_another_image_size(tmp_path, classifier):
    source = random_model(classifier=classifier)
    path = write(convert.from_pycls(source, "timm"), tmp_path / "w.safetensors")
    target = VisionTransformer(**{**ARGS, "image_size": 24}, num_classes=10, classifier=classifier)
    weights_files.load_weights(path, target)
    expected = resample_pos_embed(source.pos_embed, 6, num_prefix_tokens=source.num_prefix_tokens)
    assert torch.equal(target.pos_embed, expected)
    assert same_weights(source, target, skip={"pos_embed"})


def test_timm_no_embed_class_file_gets_zero_prefix_rows(tmp_path):
    timm_vit = pytest.importorskip("timm.models.vision_transformer")
    timm_model = timm_vit.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0,
        num_classes=10, no_embed_class=True, reg_tokens=1,
    ).eval()  # fmt: skip
    path = write(timm_model.state_dict(), tmp_path / "w.safetensors")
    target = VisionTransformer(**ARGS, num_classes=10, classifier="token", num_registers=1)
    weights_files.load_weights(path, target)
    assert not target.pos_embed[:, :2].any()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(target.eval()(x), timm_model(x), rtol=1e-4, atol=1e-5)


def test_mismatches_are_all_listed(tmp_path):
    state = random_model().state_dict()
    state["blocks.0.ls1.gamma"] = torch.ones(32)  # unknown (LayerScale)
    del state["blocks.1.ln_2.weight"]  # missing
    state["blocks.0.ffn.fc1.weight"] = torch.zeros(48, 32)  # other mlp_dim
    path = write(state, tmp_path / "w.safetensors")
    with pytest.raises(weights_files.WeightsError) as info:
        weights_files.load_weights(path, VisionTransformer(**ARGS, num_classes=10))
    message = str(info.value)
    for part in ("blocks.0.ls1.gamma", "blocks.1.ln_2.weight", "blocks.0.ffn.fc1.weight: file"):
        assert part in message


def test_unreadable_and_ambiguous_files_are_clear_errors(tmp_path):
    model = VisionTransformer(**ARGS, num_classes=10)
    with pytest.raises(weights_files.WeightsError, match="does not exist"):
        weights_files.load_weights(str(tmp_path / "nope.pth"), model)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(weights_files.WeightsError, match="cannot read"):
        weights_files.load_weights(str(bad), model)
    odd = write({"w": torch.zeros(2)}, tmp_path / "odd.pth")
    with pytest.raises(weights_files.WeightsError, match="TRAIN.WEIGHTS_FORMAT"):
        weights_files.load_weights(odd, model)
    pickled = tmp_path / "obj.pth"
    torch.save({"x": nn.Linear(2, 2)}, pickled)  # a pickled module: refused, not executed
    with pytest.raises(weights_files.WeightsError, match="cannot read"):
        weights_files.load_weights(str(pickled), model)


def _checkpoint(tmp_path, *overrides):
    cfg = tiny_quickstart(tmp_path, "VIT.DEPTH", "2", *overrides)
    from pycls.core import builders

    torch.manual_seed(0)
    model = builders.build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = checkpoint.save_file(
        {"model_state": model.state_dict(), "cfg": cfg.dump(), "epoch": 1},
        str(tmp_path / "model_epoch_0001.pyth"),
    )
    return path, model.eval()


@pytest.mark.parametrize(
    "overrides",
    [[], ["VIT.CLASSIFIER", "token", "VIT.PRE_NORM", "True", "VIT.NUM_REGISTERS", "1"]],
)
def test_export_round_trip_pycls_timm_pycls_gives_identical_logits(tmp_path, overrides):
    pytest.importorskip("timm")
    path, model = _checkpoint(tmp_path, *overrides)
    out = exports.export_checkpoint(path, "timm")
    timm_model = weights_files.timm_model_from_export(out)
    back = from_timm(timm_model, layout=model.layout).eval()
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
        expected = model(x)
        assert ((timm_model(x) - expected).abs().max() / expected.abs().max()) < 1e-4
    # and the safetensors export loads back through TRAIN.WEIGHTS
    st = exports.export_checkpoint(path, "safetensors")
    assert config.cfg_from_yaml_text(weights_files.read_metadata(st)["cfg"]).VIT.DEPTH == 2
    again, _ = exports.model_from_checkpoint(st)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


TIMM_ONLY = """
{recipe}
kwargs = json.loads(meta["timm_kwargs"])
overlay = {{**kwargs.pop("pretrained_cfg_overlay"), "file": path}}
same = timm.create_model(
    meta["timm_model"], pretrained=True, pretrained_cfg_overlay=overlay, **kwargs
)
import sys, torch
assert not any(m == "pycls" or m.startswith("pycls.") for m in sys.modules), "pycls imported"
x = torch.load({x!r})
with torch.no_grad():
    torch.save([model.eval()(x), same.eval()(x)], {out!r})
"""


def _docs_timm_recipe():
    """The timm block of docs/finetuning.md, as written."""
    with open(os.path.join(ROOT, "docs", "finetuning.md")) as f:
        text = f.read()
    marker = "tests/checkpoint/test_weights.py runs this block as written) -->\n```python\n"
    return text.split(marker, 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("classifier", ["pooled", "token"])
def test_timm_export_loads_with_timm_alone_as_the_docs_say(tmp_path, classifier):
    """The docs' recipe in a process that never imports pycls, 7 classes: pycls's logits."""
    pytest.importorskip("timm")
    path, model = _checkpoint(tmp_path, "MODEL.NUM_CLASSES", "7", "VIT.CLASSIFIER", classifier)
    out = exports.export_checkpoint(path, "timm")
    recipe = _docs_timm_recipe()
    assert 'path = "/tmp/q/model_final_timm.safetensors"' in recipe
    recipe = recipe.replace("/tmp/q/model_final_timm.safetensors", out)
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    script = TIMM_ONLY.format(recipe=recipe, x=str(tmp_path / "x.pt"), out=str(tmp_path / "y.pt"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model(x)
    assert expected.shape == (3, 7)
    for logits in torch.load(tmp_path / "y.pt"):
        assert (logits - expected).abs().max() / expected.abs().max() < 1e-4


def test_exported_files_are_readable_by_others(tmp_path):
    """What open() would create under the umask (0644 under 022), not safetensors' 0600."""
    path, _ = _checkpoint(tmp_path, "VIT.CLASSIFIER", "token")
    mask = os.umask(0o022)
    try:
        for fmt in weights_files.EXPORT_FORMATS:
            out = exports.export_checkpoint(path, fmt)
            written = (
                [os.path.join(out, f) for f in os.listdir(out)] if os.path.isdir(out) else [out]
            )
            for file in written:  # a timm folder's files
                assert os.stat(file).st_mode & 0o777 == 0o644, (fmt, oct(os.stat(file).st_mode))
    finally:
        os.umask(mask)


def test_timm_export_refuses_a_norm_eps_timm_cannot_build(tmp_path):
    path, _ = _checkpoint(tmp_path, "VIT.NORM_EPS", "1e-5")
    with pytest.raises(weights_files.WeightsError, match="LayerNorm eps 1e-05"):
        exports.export_checkpoint(path, "timm")


def test_export_to_torchvision_matches_torchvision(tmp_path):
    from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT

    path, model = _checkpoint(tmp_path, "VIT.CLASSIFIER", "token")
    out = exports.export_checkpoint(path, "torchvision")
    tv = TorchvisionViT(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10,
    ).eval()  # fmt: skip
    tv.load_state_dict(torch.load(out, weights_only=True), strict=True)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(tv(x), model(x), rtol=1e-4, atol=1e-5)
    pooled, _ = _checkpoint(tmp_path / "p")
    with pytest.raises(weights_files.WeightsError, match="classifier 'pooled'"):
        exports.export_checkpoint(pooled, "torchvision")


def test_export_tool_reports_errors_in_one_line_with_the_documented_status(tmp_path, capsys):
    """A model the format cannot express, a folder without a checkpoint: mistakes, exit 2 (they
    were exit 1); one line each."""
    from tests.helpers import load_tool

    tool = load_tool("export_weights")
    pooled, _ = _checkpoint(tmp_path)
    assert tool.main([pooled, "--format", "torchvision"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "torchvision cannot represent" in line
    assert tool.main([pooled, "--format", "safetensors"]) == 0
    capsys.readouterr()
    # A run folder (or its checkpoints/ folder) stands for its newest checkpoint
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    os.replace(pooled, run / "model_epoch_0001.pyth")
    assert tool.main([str(run.parent), "--format", "safetensors"]) == 0
    assert capsys.readouterr().out.strip() == str(run / "model_epoch_0001.safetensors")
    (run / "model_epoch_0001.pyth").unlink()
    assert tool.main([str(run), "--format", "safetensors"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "is a folder holding no checkpoint" in line


def _full_disk_part_way(monkeypatch):
    """Every weights writer (safetensors' by path, torch.save's to a file) writes a little, then
    finds the disk full, as a real full disk fails a write part way."""
    import errno

    from pycls.checkpoint import weight_files

    def full():
        return OSError(errno.ENOSPC, "No space left on device")

    def safetensors_full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)
        raise full()

    def torch_full(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            f = open(f, "wb")  # noqa: SIM115 (written in place, as a full disk leaves it)
        f.write(b"PK\x03\x04" + b"\x00" * 100)
        raise full()

    monkeypatch.setattr(weight_files, "save_file", safetensors_full)
    monkeypatch.setattr(torch, "save", torch_full)


@pytest.mark.parametrize("fmt", ["safetensors", "timm", "torchvision"])
def test_an_export_over_an_earlier_one_on_a_full_disk_keeps_the_earlier_one(
    tmp_path, monkeypatch, fmt
):
    if fmt == "timm":
        pytest.importorskip("timm")
    path, _ = _checkpoint(tmp_path, "VIT.CLASSIFIER", "token")
    name = f"model_{fmt}." + ("pth" if fmt == "torchvision" else "safetensors")
    out = exports.export_checkpoint(path, fmt, str(tmp_path / "exported" / name))
    good = Path(out).read_bytes()
    with monkeypatch.context() as m:
        _full_disk_part_way(m)
        # the torchvision writer names the file (CheckpointWriteError), the others raise OSError
        with pytest.raises((OSError, CheckpointWriteError), match="No space left"):
            exports.export_checkpoint(path, fmt, out)
    assert Path(out).read_bytes() == good  # intact, byte for byte
    assert os.listdir(tmp_path / "exported") == [name]  # no partial file left
    if fmt != "torchvision":
        assert weights_files.read_state_dict(out)  # and loads
    else:
        assert torch.load(out, weights_only=True)


def test_final_weights_survive_a_full_disk_on_rewrite(tmp_path, monkeypatch):
    from pycls.checkpoint import weight_files

    path = weight_files.final_weights_path(str(tmp_path))
    weight_files.save_safetensors(random_model().state_dict(), path, {"naming": "pycls"})
    good = Path(path).read_bytes()
    with monkeypatch.context() as m:
        _full_disk_part_way(m)
        with pytest.raises(OSError, match="No space left"):
            weight_files.save_safetensors(random_model(1).state_dict(), path)
    assert Path(path).read_bytes() == good and os.listdir(tmp_path) == [os.path.basename(path)]


def _safetensors_disk_full(tensors, path, metadata=None):
    raise SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )


def _torch_disk_full(obj, path, *args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed "
                       "writing file data/0: file write failed")  # fmt: skip


@pytest.mark.parametrize(
    "fmt, target, fake",
    [
        ("safetensors", "save_file", _safetensors_disk_full),
        ("timm", "save_file", _safetensors_disk_full),
        ("torchvision", "torch.save", _torch_disk_full),
    ],
)
def test_a_full_disk_while_exporting_is_one_line_with_exit_status_1(
    tmp_path, capsys, monkeypatch, fmt, target, fake
):
    """Every writer's failure on a full disk is the machine's: one line naming the file and the
    cause, exit 1, no traceback, nothing left beside it."""
    from tests.helpers import load_tool

    tool = load_tool("export_weights")
    path, _ = _checkpoint(tmp_path, "VIT.CLASSIFIER", "token")
    if target == "save_file":
        monkeypatch.setattr(weights_files, "save_file", fake)
    else:
        monkeypatch.setattr(weights_files.torch, "save", fake)
        monkeypatch.setattr(errors, "_free_bytes", lambda path: 0)  # the disk is full
    out = tmp_path / "exported" / "w.out"
    assert tool.main([path, "--format", fmt, "--out", str(out)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and str(out) in line and "No space left" in line, line
    assert not out.parent.exists() or os.listdir(out.parent) == []


def _pickled_module(path):
    torch.save({"x": nn.Linear(2, 2)}, path)


def _cut_torch_file(path):
    torch.save({"w": torch.zeros(64)}, path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def _bytes(data):
    return lambda path: Path(path).write_bytes(data)


# Files given where weights are expected, and the words their one line must hold
_NOT_WEIGHTS = {
    "a text file": (_bytes(b"hello\n"), "not a weights file"),
    "a JSON file": (_bytes(b'{"a": 1}\n'), "not a weights file"),
    "a config": (_bytes(b"OPTIM:\n  BASE_LR: 0.1\n"), "not a weights file"),
    "a PNG": (_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64)), "not a weights file"),
    "an empty file": (_bytes(b""), "empty, not a weights file"),
    "pickled objects": (_pickled_module, "holds Python objects"),
    "a torch file cut short": (_cut_torch_file, "truncated or corrupt?"),
}


@pytest.mark.parametrize("what", list(_NOT_WEIGHTS))
@pytest.mark.parametrize("entry", ["TRAIN.WEIGHTS", "checkpoint", "export"])
def test_a_file_that_is_not_weights_is_named_so_and_never_given_torchs_advice(
    tmp_path, what, entry
):
    """torch's message for a file its weights-only loader refuses says to load it again with
    weights_only=False, which runs the file's code: never for a file of unknown origin. Each
    entry point says what the file is instead."""
    make, words = _NOT_WEIGHTS[what]
    path = str(tmp_path / "given.pth")
    make(path)
    model = VisionTransformer(**ARGS, num_classes=10)
    with pytest.raises((weights_files.WeightsError, checkpoint.CheckpointError)) as e:
        if entry == "TRAIN.WEIGHTS":
            weights_files.load_weights(path, model)
        elif entry == "checkpoint":
            checkpoint.load_file(path)
        else:
            exports.export_checkpoint(path, "safetensors")
    message = str(e.value)
    assert path in message and words in message, message
    assert "weights_only" not in message and len(message.splitlines()) == 1, message


# A file of one ViT layout given to a model of another: (the file's model, the model's, the
# words of the hint, the model the hint describes); image sizes differ, so the position
# embedding is resampled once the layouts agree
_LAYOUTS = {
    "class token into pooled": (
        dict(classifier="token"),
        dict(classifier="pooled"),
        "the file has a class token (class_token): set VIT.CLASSIFIER token",
        dict(classifier="token"),
    ),
    "class token kept by a pooled model": (
        dict(classifier="pooled", class_token=True),
        dict(classifier="pooled"),
        "VIT.CLASS_TOKEN True",
        dict(classifier="pooled", class_token=True),
    ),
    "pooled into a class-token model": (
        dict(classifier="pooled"),
        dict(classifier="token"),
        "the file has no class token: set VIT.CLASSIFIER pooled",
        dict(classifier="pooled"),
    ),
    "a norm after pooling": (
        dict(classifier="pooled", fc_norm=True),
        dict(classifier="pooled"),
        "the file has a norm after pooling (fc_norm): set VIT.FC_NORM True",
        dict(classifier="pooled", fc_norm=True),
    ),
    "registers": (
        dict(num_registers=2),
        dict(),
        "the file has 2 register tokens: set VIT.NUM_REGISTERS 2",
        dict(num_registers=2),
    ),
    "a norm before the blocks": (
        dict(pre_norm=True),
        dict(),
        "set VIT.PRE_NORM True",
        dict(pre_norm=True),
    ),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("naming", ["timm", "pycls"])
def test_a_file_of_another_vit_layout_names_the_keys_that_fit_it(tmp_path, layout, naming):
    """Fine-tuning from a file whose layout differs (class token, registers, norms) names the
    keys that give the model the file's layout and says the position embedding will be
    resampled; with those keys the file loads."""
    file_kw, model_kw, words, hinted_kw = _LAYOUTS[layout]
    source = random_model(**file_kw)
    state = convert.from_pycls(source, naming) if naming == "timm" else source.state_dict()
    path = write(state, tmp_path / "w.safetensors")
    bigger = {**ARGS, "image_size": 24}
    with pytest.raises(weights_files.WeightsError) as e:
        weights_files.load_weights(path, VisionTransformer(**bigger, num_classes=10, **model_kw))
    message = " ".join(str(e.value).split())
    assert words in message and "position embedding" in message and "resampled" in message
    weights_files.load_weights(path, VisionTransformer(**bigger, num_classes=10, **hinted_kw))


def test_a_timm_file_the_single_file_export_wrote_before_still_loads():
    """tests/data/timm_export_single_file.safetensors, written by the single-file timm export
    before the export learned timm's folders (a pooled ViT of 1 block, 16 wide, 3 classes): timm
    builds it from its metadata, and TRAIN.WEIGHTS reads it into the pycls model it came from,
    with timm's logits. Catches a reader that needs what only a newer export writes."""
    pytest.importorskip("timm")
    path = os.path.join(ROOT, "tests", "data", "timm_export_single_file.safetensors")
    timm_model = weights_files.timm_model_from_export(path)
    model = VisionTransformer(image_size=16, patch_size=8, depth=1, width=16, num_heads=2,
                              mlp_dim=32, num_classes=3, classifier="pooled").eval()  # fmt: skip
    weights_files.load_weights(path, model, new_head=False)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), timm_model(x), rtol=1e-4, atol=1e-6)
        assert model(x).abs().max() > 1e-3  # a head that was read, not a zero one


TIMM_FOLDER_ONLY = """
import sys, timm, torch
from timm.data import resolve_data_config
model = timm.create_model("local-dir:" + {folder!r}, pretrained=True).eval()
assert not any(m == "pycls" or m.startswith("pycls.") for m in sys.modules), "pycls imported"
with torch.no_grad():
    torch.save([model(torch.load({x!r})), resolve_data_config(model=model)], {out!r})
"""


def test_timm_folder_loads_with_timm_alone(tmp_path):
    """--format timm_folder writes what timm stores itself (config.json, model.safetensors):
    timm.create_model("local-dir:...", pretrained=True) in a process without pycls builds the
    network, loads the weights and evaluates as the run did (its mean, std, crop). Catches a
    config.json field timm does not read (the class count, the model arguments) or misses."""
    pytest.importorskip("timm")
    path, model = _checkpoint(tmp_path, "MODEL.NUM_CLASSES", "7", "VIT.LAYER_SCALE_INIT", "0.1",
                              "VIT.QK_NORM", "layer")  # fmt: skip
    folder = exports.export_checkpoint(path, "timm_folder")
    assert folder.endswith("_timm") and sorted(os.listdir(folder)) == [
        "config.json", "model.safetensors"]  # fmt: skip
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    script = TIMM_FOLDER_ONLY.format(folder=folder, x=str(tmp_path / "x.pt"),
                                     out=str(tmp_path / "y.pt"))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    logits, data = torch.load(tmp_path / "y.pt")
    with torch.no_grad():
        expected = model(x)
    assert expected.shape == (3, 7)
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4
    _, cfg = exports.model_from_checkpoint(path)
    want = exports.data_config(cfg)
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()} == want


FOLDER_MODELS = {
    "DINOv3-like (timm's Eva)": dict(rope="dinov3", rope_layout="half", pos_embed="none",
                                     norm_eps=1e-5, layer_scale_init=1e-5, num_registers=4,
                                     qkv_bias=False),
    "EVA-02-like (timm's Eva)": dict(ffn="swiglu", ffn_norm=True, rope="axial", key_bias=False,
                                     classifier="pooled", fc_norm=True),
    "parallel blocks, RMSNorm": dict(block="parallel", norm_layer="rms", qk_norm="rms"),
    "packed SwiGLU": dict(ffn="swiglu_packed", ffn_width="two_thirds", mlp_dim=96),
    "head-less attention pool": dict(num_classes=0, classifier="map", class_token=False),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FOLDER_MODELS))
def test_timm_folder_of_the_block_features(tmp_path, name):
    """Each family's folder loads with timm.create_model("local-dir:...") alone, timm's class
    the one that represents it exactly (an Eva for RoPE and EVA's biases), with pycls's logits;
    back through from_timm it is the model it was, bitwise. A head-less model too."""
    pytest.importorskip("timm")
    import timm

    model = random_model(**FOLDER_MODELS[name], image_size=32, patch_size=16, head_init_scale=1.0)
    folder = weights_files.export_model(model, "", "timm_folder", str(tmp_path / "f"))
    timm_model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert type(timm_model).__name__ == ("Eva" if "Eva" in name else "VisionTransformer")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        assert (timm_model(x) - expected).abs().max() / expected.abs().max() < 1e-4
        assert torch.equal(from_timm(timm_model).eval()(x), expected)
    assert model.num_classes or expected.shape == (2, 32)
