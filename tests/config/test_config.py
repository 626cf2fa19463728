"""The config tree: documentation of every key, validation errors that name the key."""

import glob
import os
import re

import pytest

from pycls import config
from pycls.config import ConfigError, load_cfg
from pycls.config.sections import SECTIONS
from tests.helpers import ROOT, scaled


def _all_keys(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _all_keys(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def _section_lines():
    """The lines of every config section (pycls/config/sections/), where the keys are defined."""
    for path in sorted(glob.glob(os.path.join(ROOT, "pycls", "config", "sections", "*.py"))):
        with open(path) as f:
            yield f.read().splitlines()


def test_every_key_is_documented_where_it_is_defined():
    """A hand-written key has a comment above it; a key generated from a record's field
    (``pycls.config.records``) has the field's meaning as its reference (the section's
    ``REFERENCE``), which must say something."""
    assignment = re.compile(r"^_C\.([A-Z0-9_.]+) = ")
    documented = set()
    for lines in _section_lines():
        documented |= _documented(lines, assignment)
    for section in SECTIONS:
        documented |= {k for k, text in getattr(section, "REFERENCE", {}).items() if text.strip()}
    missing = sorted(set(_all_keys(config.get_default_cfg())) - documented)
    assert not missing, f"keys without a comment above their definition: {missing}"


def _documented(lines, assignment):
    documented = set()
    for i, line in enumerate(lines):
        m = assignment.match(line)
        if not m or line.rstrip().endswith("CfgNode()"):
            continue
        j = i - 1
        while j >= 0 and assignment.match(lines[j]):  # a run of keys shares one comment
            j -= 1
        if lines[j].startswith("#"):
            documented.add(m.group(1))
    return documented


def test_defaults_are_valid():
    config.assert_cfg(config.get_default_cfg())


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))
)
def test_shipped_configs_load(path):
    if os.sep + "sweeps" + os.sep in path:
        pytest.skip("sweep files have their own schema")
    as_written = load_cfg(path, validate=False, for_this_machine=False)
    # a folder for the data sets that read one (a digits config refuses a DATA.PATH it ignores)
    reads_folder = as_written.TRAIN.DATASET not in ("digits", "synthetic")
    cfg = load_cfg(path, ["DATA.PATH", "/data"] if reads_folder else [])
    assert cfg.is_frozen()


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["TRAIN.NOT_A_KEY", "1"], "TRAIN.NOT_A_KEY", "unknown config key"),
        (["TRAIN.IM_SIZE", "big"], "TRAIN.IM_SIZE", "takes a whole number, got text: 'big'"),
        (["VIT.LAYOUT", "nchw"], "VIT.LAYOUT", "'batch_first', 'batch_second'"),
        (["AMP.LEVEL", "O4"], "AMP.LEVEL", "'O0', 'O1', 'O2', 'O3'"),
        (["TRAIN.IM_SIZE", "230"], "TRAIN.IM_SIZE", "not divisible by VIT.PATCH_SIZE=16"),
        (["VIT.NUM_HEADS", "7"], "VIT.WIDTH", "not divisible by VIT.NUM_HEADS=7"),
        (["TRAIN.BATCH_SIZE", "0"], "TRAIN.BATCH_SIZE", "must be > 0"),
        (["OPTIM.BASE_LR", "-0.1"], "OPTIM.BASE_LR", "must be >= 0"),
        (["OPTIM.BETAS", "[0.9]"], "OPTIM.BETAS", "two values"),
        (["OPTIM.LR_POLICY", "steps"], "OPTIM.STEPS", "at least one step"),
        (["TRAIN.DATASET", "imagefolder"], "DATA.PATH", "needs a data folder"),
        (["DATA_LOADER.BACKEND", "shards"], "DATA_LOADER.SHARD_PATH", "needs the folder"),
        (
            ["DATA_LOADER.AUGMENT_DEVICE", "gpu", "DEVICE", "cpu"],
            "DATA_LOADER.AUGMENT_DEVICE",
            "needs a CUDA device",
        ),
        (
            [
                "VIT.STEM_TYPE",
                "conv",
                "VIT.C_STEM_STRIDES",
                "[2, 2, 2]",
                "VIT.C_STEM_CHANNELS",
                "[8, 8, 8]",
                "VIT.C_STEM_KERNELS",
                "[3, 3, 3]",
            ],
            "VIT.C_STEM_STRIDES",
            "must equal VIT.PATCH_SIZE",
        ),
        (["MODEL.ARCH", "vit_z99"], "MODEL.ARCH", "vit_b16"),
        (["VIT.DROP_PATH", "1.5"], "VIT.DROP_PATH", "must be < 1"),
        (["VIT.ATTENTION_BACKEND", "fast"], "VIT.ATTENTION_BACKEND", "'default', 'cudnn'"),
        (["VIT.ATTENTION_BACKEND", "flash", "DEVICE", "cpu"], "VIT.ATTENTION_BACKEND",
         "DEVICE cpu: the flash kernel needs CUDA"),
        (["VIT.ATTENTION_BACKEND", "efficient", "DEVICE", "cpu"], "VIT.ATTENTION_BACKEND",
         "DEVICE cpu: the efficient kernel needs CUDA"),
        (["VIT.ATTENTION_BACKEND", "cudnn", "DEVICE", "cuda"], "VIT.ATTENTION_BACKEND",
         "AMP.LEVEL O0: the cudnn kernel takes float16 or bfloat16 inputs only"),
        (["VIT.ATTENTION_BACKEND", "efficient", "DEVICE", "cuda", "TRAIN.TOKEN_BUDGET", "1024"],
         "VIT.ATTENTION_BACKEND", "TRAIN.TOKEN_BUDGET: a token batch's attention goes through"),
        (["VIT.ATTENTION_BACKEND", "math", "MODEL.TYPE", "resnet", "MODEL.DEPTH", "50",
          "RESNET.TRANS_FUN", "bottleneck_transform"],
         "VIT.ATTENTION_BACKEND", "MODEL.TYPE resnet has no attention"),
        (["AMP.RESIDUAL_DTYPE", "float16"], "AMP.RESIDUAL_DTYPE", "'float32', 'bfloat16'"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_cfg(None, overrides)
    assert str(e.value).startswith(key), str(e.value)
    assert words in str(e.value), str(e.value)


def test_a_timm_preset_without_timm_is_refused_at_load(monkeypatch):
    """TRAIN.AUGMENT deit3_finetune runs timm's RandAugment: without timm the config says so in
    one line at load, before a loader worker would fail on it. Caught: the check left out."""
    import importlib.util

    find_spec = importlib.util.find_spec
    no_timm = lambda name, *a: None if name == "timm" else find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", no_timm)
    with pytest.raises(ConfigError, match=r"^TRAIN.AUGMENT: deit3_finetune .*pip install timm"):
        load_cfg(None, ["TRAIN.AUGMENT", "deit3_finetune"])
    load_cfg(None, ["TRAIN.AUGMENT", "three_augment"])


def test_bad_yaml_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("OPTIM:\n  BASE_LR: 0.1\n  MOMENTUMM: 0.9\n")
    with pytest.raises(ConfigError, match="OPTIM.MOMENTUMM"):
        load_cfg(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_cfg(str(tmp_path / "missing.yaml"))


def test_bundled_configs_by_name_and_a_real_path_wins(tmp_path, monkeypatch):
    bundled = os.path.join(ROOT, "configs", "vit_b16.yaml")
    for name in ("vit_b16", "vit_b16.yaml", "configs/vit_b16.yaml"):
        assert os.path.samefile(config.resolve_cfg_file(name), bundled), name
    assert load_cfg("cifar/vit_ti4_cifar10").TRAIN.DATASET == "cifar10"
    monkeypatch.chdir(tmp_path)  # a file of the same name in the working folder wins
    (tmp_path / "vit_b16.yaml").write_text("OPTIM:\n  BASE_LR: 0.123\n")
    assert load_cfg("vit_b16.yaml").OPTIM.BASE_LR == 0.123
    assert load_cfg("vit_b16").OPTIM.BASE_LR != 0.123  # no such file here: the bundled one
    with pytest.raises(ConfigError, match="nor is it a bundled config .*quickstart"):
        load_cfg("no_such_config")


def test_integers_are_accepted_for_float_keys(tmp_path):
    path = tmp_path / "ints.yaml"
    path.write_text("OPTIM:\n  BASE_LR: 1\n  MIN_LR: 0\n")
    cfg = load_cfg(str(path), ["OPTIM.WEIGHT_DECAY", "0"])
    assert cfg.OPTIM.BASE_LR == 1.0 and isinstance(cfg.OPTIM.BASE_LR, float)
    assert cfg.OPTIM.WEIGHT_DECAY == 0.0 and isinstance(cfg.OPTIM.WEIGHT_DECAY, float)


def test_arch_fills_the_vit_sizes():
    cfg = load_cfg(None, ["MODEL.ARCH", "vit_h14"])
    assert (cfg.VIT.PATCH_SIZE, cfg.VIT.DEPTH, cfg.VIT.WIDTH) == (14, 32, 1280)
    assert (cfg.VIT.NUM_HEADS, cfg.VIT.MLP_DIM) == (16, 5120)


def test_explicit_vit_keys_win_over_the_arch_preset(tmp_path):
    ti16 = os.path.join(ROOT, "configs", "vit_ti16.yaml")
    cfg = load_cfg(ti16, ["VIT.DEPTH", "6"])  # a 6-block ViT-Ti, not a 12-block one
    assert (cfg.MODEL.ARCH, cfg.VIT.DEPTH, cfg.VIT.WIDTH, cfg.VIT.NUM_HEADS) == (
        "vit_ti16",
        6,
        192,
        3,
    )
    path = tmp_path / "arch.yaml"
    path.write_text("VIT:\n  WIDTH: 96\n")  # a file's VIT key wins over an ARCH given later too
    cfg = load_cfg(str(path), ["MODEL.ARCH", "vit_s16"])
    assert (cfg.VIT.WIDTH, cfg.VIT.DEPTH, cfg.VIT.NUM_HEADS) == (96, 12, 6)
    # the resolved config written to OUT_DIR reloads to itself
    cfg = load_cfg(ti16, ["VIT.DEPTH", "6", "OUT_DIR", str(tmp_path)])
    assert load_cfg(config.dump_cfg(cfg)) == cfg


def test_dump_round_trip(tmp_path):
    cfg = load_cfg(os.path.join(ROOT, "configs", "quickstart.yaml"), ["OUT_DIR", str(tmp_path)])
    path = config.dump_cfg(cfg)
    assert path == os.path.join(str(tmp_path), "config.yaml")
    again = load_cfg(path)
    assert again == cfg
    assert config.cfg_from_yaml_text(cfg.dump()) == cfg


def test_odd_override_list():
    with pytest.raises(ConfigError, match="KEY VALUE pairs"):
        load_cfg(None, ["TRAIN.IM_SIZE"])


# ------------------------------------------------------------------------------------------------ #
# Hostile or malformed config files: one line, exit 2, nothing written, in bounded time and memory
# ------------------------------------------------------------------------------------------------ #


def _alias_bomb(key_line, levels=9, fan=9):
    """YAML of a few hundred bytes whose aliases expand to ``fan ** levels`` values under the
    list key that ``key_line`` opens."""
    parts = [f"&l0 [{', '.join(['0'] * fan)}]"]
    for i in range(1, levels):
        parts.append(f"&l{i} [{', '.join([f'*l{i - 1}'] * fan)}]")
    return f"{key_line} [{', '.join(parts)}]\n"


def _merge_key_bomb(levels=8, fan=9):
    """YAML whose merge keys (``<<``) copy mappings into mappings: PyYAML itself expands these
    while reading, so the size must be bounded before the file is read into values."""
    lines = ["l0: &l0 {A: 0, B: 0}"]
    for i in range(1, levels):
        pairs = [f"<<: *l{i - 1}"] + [f"K{j}: *l{i - 1}" for j in range(1, fan)]
        lines.append(f"l{i}: &l{i} {{{', '.join(pairs)}}}")
    return ("\n".join(lines) + "\n").encode()


_HOSTILE = {
    "alias bomb under a list key": (
        _alias_bomb("DATA:\n  CLASSES:").encode(),
        "expands to more than",
    ),
    "alias bomb under another list key": (
        _alias_bomb("OPTIM:\n  STEPS:", levels=7, fan=12).encode(),
        "expands to more than",
    ),
    "alias bomb of mappings": (_merge_key_bomb(), "expands to more than"),
    "alias that contains itself": (b"DATA:\n  CLASSES: &a [1, *a]\n", "refers to itself"),
    "file of 2 MB": (b"# padding\n" * 200_000 + b"RNG_SEED: 2\n", "bytes; a config file"),
    "integer key": (b"VIT:\n  1: 2\n", "key 1 (line 2) is not a name"),
    "integer key at the top": (b"1: 2\n", "key 1 (line 1) is not a name"),
    "null key": (b"OPTIM:\n  ~: 2\n", "key None (line 2) is not a name"),
    "boolean key": (b"OPTIM:\n  true: 2\n", "key True (line 2) is not a name"),
    "latin-1 byte": ("OUT_DIR: /tmp/caf\xe9\n".encode("latin-1"), "not UTF-8 text (byte 0xe9"),
    "UTF-16": ("OPTIM:\n  BASE_LR: 0.1\n".encode("utf-16"), "is UTF-16 text"),
    "UTF-32": ("OPTIM:\n  BASE_LR: 0.1\n".encode("utf-32"), "is UTF-32 text"),
    "nested list in a pair": (b"OPTIM:\n  BETAS: [[0.9], 0.99]\n", "OPTIM.BETAS: holds [0.9]"),
    "nested lists in a triple": (b"DATA:\n  MEAN: [[0.5], [0.5], [0.5]]\n", "DATA.MEAN: holds"),
    "nested list in steps": (b"OPTIM:\n  STEPS: [[1, 2], 3]\n", "OPTIM.STEPS: holds [1, 2]"),
    "mapping in a list": (b"ANYNET:\n  DEPTHS: [{A: 1}]\n", "ANYNET.DEPTHS: holds {'A': 1}"),
    "null in a list": (b"VIT:\n  C_STEM_CHANNELS: [~, 2]\n", "VIT.C_STEM_CHANNELS: holds None"),
    "boolean in a list": (b"DATA:\n  CLASSES: [true]\n", "DATA.CLASSES: holds True"),
    "list for a number": (b"OPTIM:\n  BASE_LR: [0.1]\n", "OPTIM.BASE_LR"),
    "mapping for a number": (b"OPTIM:\n  BASE_LR: {A: 1}\n", "OPTIM.BASE_LR"),
    "negative seed": (b"RNG_SEED: -5\n", "RNG_SEED: must be in [0, 2147483647]"),
    "huge seed": (b"RNG_SEED: 1099511627776\n", "RNG_SEED: must be in [0, 2147483647]"),
    "100 KB of floats": (
        b"DATA:\n  MEAN: [" + b", ".join([b"0.123456"] * 12_000) + b"]\n",
        "DATA.MEAN: needs 0 (data set default) or 3 values, got 12000: [0.123456, 0.123456,",
    ),
    "100 KB of floats, one not finite": (
        b"OPTIM:\n  STEPS: [" + b", ".join([b"1.5"] * 12_000) + b", .inf]\n",
        "OPTIM.STEPS: must be a finite number, got inf in [1.5, 1.5,",
    ),
}


@pytest.mark.parametrize("case", list(_HOSTILE))
def test_hostile_config_files_are_one_line_exit_2_and_nothing_written(tmp_path, capsys, case):
    import resource
    import time

    from pycls.core import cli

    data, words = _HOSTILE[case]
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_bytes(data)
    out = tmp_path / "out"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    assert cli.main(["--mode", "train", "--cfg", str(cfg_file), "OUT_DIR", str(out)]) == 2
    assert time.perf_counter() - started < scaled(10)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 300_000  # KB
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("config error: ") and words in line, line
    assert len(line) < 600, line  # values are shown shortened
    assert not out.exists()


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("OPTIM.BETAS", "[[0.9], 0.99]", "OPTIM.BETAS: holds [0.9]"),
        ("DATA.MEAN", "[[0.5], [0.5], [0.5]]", "DATA.MEAN: holds [0.5]"),
        ("RNG_SEED", "-5", "RNG_SEED: must be in [0, 2147483647]"),
    ],
)
def test_hostile_overrides_are_one_line_exit_2_too(tmp_path, capsys, key, value, words):
    from pycls.core import cli

    out = tmp_path / "out"
    assert (
        cli.main(["--mode", "train", "--cfg", "quickstart", key, value, "OUT_DIR", str(out)]) == 2
    )
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("config error: ") and words in line, line
    assert not out.exists()
