"""Fine-tuning controls: layer-wise LR decay groups, freezing, head init, their config keys."""

import pytest
import torch

from pycls import config
from pycls.core import builders, finetune
from pycls.core.builders import build_optimizer as construct_optimizer
from pycls.core.schedules import set_lr
from tests.helpers import tiny_quickstart

pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest.py

DEPTH = 3


def _cfg(tmp_path, *overrides):
    return tiny_quickstart(tmp_path, "VIT.DEPTH", str(DEPTH), *overrides)


def _group_of(optimizer):
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def _expected_layer(name):
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    if name.split(".")[0] in ("patch_embed", "class_token", "pos_embed", "register_tokens"):
        return 0
    return DEPTH + 1


@pytest.mark.parametrize("extra", [[], ["VIT.CLASSIFIER", "token", "VIT.NUM_REGISTERS", "2"]])
def test_layer_decay_gives_each_parameter_its_exact_rate(tmp_path, extra):
    cfg = _cfg(tmp_path, "OPTIM.LAYER_DECAY", "0.5", "OPTIM.BASE_LR", "0.1", *extra)
    model = builders.build_model(cfg)
    optimizer = construct_optimizer(cfg, model)
    groups = _group_of(optimizer)
    no_decay = model.no_weight_decay_names()
    seen_layers = set()
    for schedule_lr in (0.1, 0.02):
        set_lr(optimizer, schedule_lr)
        for name, p in model.named_parameters():
            layer = _expected_layer(name)
            seen_layers.add(layer)
            # head: the scheduled rate; block i: decay^(depth - i); embedding: decay^(depth + 1)
            expected = schedule_lr * {0: 0.5**4, 1: 0.5**3, 2: 0.5**2, 3: 0.5, 4: 1.0}[layer]
            group = groups[id(p)]
            assert group["lr"] == pytest.approx(expected, rel=1e-12, abs=0), name
            wd = 0.0 if name in no_decay else cfg.OPTIM.WEIGHT_DECAY
            assert group["weight_decay"] == wd, name
    assert seen_layers == {0, 1, 2, 3, 4}
    assert groups[id(model.head.weight)]["lr"] == 0.02
    assert groups[id(model.pos_embed)]["lr"] == pytest.approx(0.02 * 0.5**4)
    if extra:
        assert groups[id(model.register_tokens)]["lr"] == pytest.approx(0.02 * 0.5**4)


def test_without_layer_decay_the_two_weight_decay_groups_remain(tmp_path):
    cfg = _cfg(tmp_path)
    optimizer = construct_optimizer(cfg, builders.build_model(cfg))
    assert [g["name"] for g in optimizer.param_groups] == ["decay", "no_decay"]
    assert all("lr_scale" not in g for g in optimizer.param_groups)


def _train_a_few_steps(cfg, model, steps=3):
    optimizer = construct_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 3, 16, 16, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("contiguous", ["False", "True"])
@pytest.mark.parametrize(
    "freeze, trainable_prefixes",
    [
        ("head", ("head.",)),
        ("last_1", ("head.", "norm.", "blocks.2.")),
        ("last_2", ("head.", "norm.", "blocks.2.", "blocks.1.")),
    ],
)
def test_frozen_parameters_stay_bitwise_unchanged(tmp_path, freeze, trainable_prefixes, contiguous):
    # Weight decay and layer decay on: a frozen parameter in any optimizer group would move
    # (in contiguous mode a missing gradient counts as zero, and weight decay still applies)
    cfg = _cfg(
        tmp_path,
        "OPTIM.CONTIGUOUS_PARAMS",
        contiguous,
        "TRAIN.FREEZE",
        freeze,
        "OPTIM.LAYER_DECAY",
        "0.7",
        "VIT.HEAD_INIT_SCALE",
        "1",
    )
    model = builders.build_model(cfg)
    finetune.prepare_model(cfg, model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_a_few_steps(cfg, model)
    for name, p in model.named_parameters():
        trainable = name.startswith(trainable_prefixes)
        assert p.requires_grad == trainable, name
        if trainable:
            assert not torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name]), name
            assert p.grad is None, name


def test_head_init_scale(tmp_path):
    zero = builders.build_model(_cfg(tmp_path))
    assert not zero.head.weight.any() and not zero.head.bias.any()
    torch.manual_seed(0)
    scaled = builders.build_model(_cfg(tmp_path, "VIT.HEAD_INIT_SCALE", "0.001"))
    std = scaled.head.weight.std().item()
    assert 1e-5 < std < 3e-5  # truncated normal with std 0.02 * 0.001
    assert not scaled.head.bias.any()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["TRAIN.FREEZE", "last_4"], "TRAIN.FREEZE"),  # more blocks than VIT.DEPTH
        (["TRAIN.FREEZE", "backbone"], "TRAIN.FREEZE"),
        (["OPTIM.LAYER_DECAY", "0.0"], "OPTIM.LAYER_DECAY"),
        (["OPTIM.LAYER_DECAY", "1.5"], "OPTIM.LAYER_DECAY"),
        (["TRAIN.WEIGHTS_FORMAT", "onnx"], "TRAIN.WEIGHTS_FORMAT"),
        (["DATA.CLASSES", "[1, 1]"], "DATA.CLASSES"),
    ],
)
def test_bad_finetune_values_fail_at_load_time_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(config.ConfigError, match=key):
        _cfg(tmp_path, *overrides)


def test_class_subset_relabels(tmp_path):
    cfg = _cfg(tmp_path, "DATA.CLASSES", "[7, 3]")
    dataset = builders.build_dataset(cfg, train=False)
    from pycls.datasets.formats.digits import Digits

    full = Digits("test")
    assert len(dataset) == int(((full.labels == 7) | (full.labels == 3)).sum())
    assert set(dataset.base.labels.tolist()) == {0, 1}
    assert dataset.base.num_classes == 2


# ---- starting from a timm model on disk (docs/finetuning.md) ---------------------------------

# Random-init stand-ins of what a user downloads, saved as timm saves them (save_for_hf); small
# enough for the tiny quickstart, each with its family's block
ON_DISK = {
    "DINOv2": ("vit_small_patch14_reg4_dinov2", 28),
    "SigLIP 2": ("vit_base_patch16_siglip_224", 32),
    "EVA-02": ("eva02_base_patch14_224", 28),
}


def _docs_block():
    import os

    from tests.helpers import ROOT

    with open(os.path.join(ROOT, "docs", "finetuning.md")) as f:
        text = f.read()
    marker = "tests/core/test_finetune.py runs this block as written) -->\n```python\n"
    return text.split(marker, 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("family", list(ON_DISK))
def test_the_docs_start_from_a_timm_folder_on_disk(tmp_path, capsys, family):
    """The docs' block as written, on a timm folder: the VIT keys it prints, given to the config,
    build the network whose TRAIN.WEIGHTS are the folder's model.safetensors (timm's naming,
    detected), with timm's logits. Catches a key vit_keys leaves out or gets wrong (a DINOv2 with
    no LayerScale, a SigLIP that pools by mean, an EVA-02 without its RoPE), and a weights file the
    trainer's loader cannot take in timm's naming."""
    timm = pytest.importorskip("timm")
    from timm.models import save_for_hf

    from pycls.checkpoint import weight_files

    arch, side = ON_DISK[family]
    torch.manual_seed(0)
    timm_model = timm.create_model(arch, pretrained=False, depth=1, embed_dim=32, num_heads=2,
                                   num_classes=10, img_size=side).eval()  # fmt: skip
    with torch.no_grad():
        for p in timm_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = tmp_path / arch
    save_for_hf(timm_model, str(folder), safe_serialization=True)  # as the hub holds them
    base = tiny_quickstart(tmp_path / "run", "TRAIN.IM_SIZE", str(side), "TEST.IM_SIZE", str(side))
    block = _docs_block()
    block = block.replace("/data/weights/vit_small_patch14_reg4_dinov2.lvd142m", str(folder))
    block = block.replace(
        'config.read_cfg("configs/finetune/vit_b16_in1k_to_cifar100.yaml")', "BASE"
    )
    exec(block, {"BASE": base})
    keys = capsys.readouterr().out.split()
    weights = str(folder / "model.safetensors")
    cfg = tiny_quickstart(tmp_path / "run", "TRAIN.IM_SIZE", str(side), "TEST.IM_SIZE", str(side),
                          *keys, "TRAIN.WEIGHTS", weights)  # fmt: skip
    model = builders.build_model(cfg).eval()
    weight_files.load_weights(weights, model, cfg.TRAIN.WEIGHTS_FORMAT, new_head=False)
    x = torch.randn(2, 3, side, side)
    with torch.no_grad():
        expected = timm_model(x)
        assert (model(x) - expected).abs().max() / expected.abs().max() < 1e-4
