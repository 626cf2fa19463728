"""Config keys generated from a settings record's fields (``pycls.config.records``, declared with
``pycls.options.option``): the VIT keys from ``VitArgs`` are the keys written by hand before them,
with the same defaults, owners, value tables and arguments; a record of any key group; a new ViT
option is its field alone; the key reference of docs/configs.md is the fields' text."""

import dataclasses
import os

import pytest
from yacs.config import CfgNode

from pycls import config
from pycls.config import records, sections
from pycls.config.defaults import DEFAULTS, OWNERS
from pycls.config.sections import RECORDS, amp, key_reference, model_vit, tokens
from pycls.config.sections.key_checks import keys_read
from pycls.config.validation import FEATURES
from pycls.models.vit.args import VitArgs, VitArgsError
from pycls.options import Key, NoKey, ReadFrom, option, options_of
from tests.helpers import QUICKSTART, ROOT

# Every VIT key as the sections declared it by hand before the keys were generated: its default
# and its section
HAND_WRITTEN = {
    "VIT.PATCH_SIZE": (16, "model_vit"),
    "VIT.DEPTH": (12, "model_vit"),
    "VIT.WIDTH": (768, "model_vit"),
    "VIT.NUM_HEADS": (12, "model_vit"),
    "VIT.MLP_DIM": (3072, "model_vit"),
    "VIT.STEM_TYPE": ("patchify", "model_vit"),
    "VIT.C_STEM_CHANNELS": ([64, 128, 128, 256], "model_vit"),
    "VIT.C_STEM_KERNELS": ([3, 3, 3, 3], "model_vit"),
    "VIT.C_STEM_STRIDES": ([2, 2, 2, 2], "model_vit"),
    "VIT.CLASSIFIER": ("token", "model_vit"),
    "VIT.LAYOUT": ("batch_first", "model_vit"),
    "VIT.FFN": ("mlp", "model_vit"),
    "VIT.POS_EMBED": ("learned", "model_vit"),
    "VIT.DROPOUT": (0.0, "model_vit"),
    "VIT.ATTN_DROPOUT": (0.0, "model_vit"),
    "VIT.DROP_PATH": (0.0, "model_vit"),
    "VIT.ATTENTION_BACKEND": ("default", "model_vit"),
    "VIT.NORM_EPS": (1e-06, "model_vit"),
    "VIT.CHECKPOINT_BLOCKS": (0, "model_vit"),
    "VIT.CLASS_TOKEN": (False, "model_vit"),
    "VIT.NUM_REGISTERS": (0, "model_vit"),
    "VIT.QKV_BIAS": (True, "model_vit"),
    "VIT.PRE_NORM": (False, "model_vit"),
    "VIT.FC_NORM": (False, "model_vit"),
    "VIT.HEAD_INIT_SCALE": (0.0, "model_vit"),
    "VIT.DIST_TOKEN": (False, "model_vit"),
    "VIT.DROP_PATH_MODE": ("multiply", "tokens"),
    "VIT.PATCH_DROP": (0.0, "tokens"),
    "VIT.PATCH_DROP_SCHEDULE": ("constant", "tokens"),
    "VIT.PATCH_DROP_OFF_EPOCH": (0, "tokens"),
    "VIT.PACKED_ATTENTION": ("auto", "tokens"),
}
# Their value tables' choices
HAND_CHOICES = {
    "VIT.STEM_TYPE": ("patchify", "conv"),
    "VIT.CLASSIFIER": ("token", "pooled"),
    "VIT.LAYOUT": ("batch_first", "batch_second"),
    "VIT.FFN": ("mlp", "local"),
    "VIT.POS_EMBED": ("learned", "sincos"),
    "VIT.ATTENTION_BACKEND": ("default", "cudnn", "flash", "efficient", "math"),
}
HAND_TOKEN_CHOICES = {
    "VIT.DROP_PATH_MODE": ("multiply", "skip"),
    "VIT.PACKED_ATTENTION": ("auto", "sdpa", "flex"),
    "VIT.PATCH_DROP_SCHEDULE": ("constant", "curriculum"),
}


def _vit_keys():
    return {k: (DEFAULTS.VIT[k[4:]], OWNERS[k]) for k in (f"VIT.{n}" for n in DEFAULTS.VIT)}


def test_the_generated_vit_keys_are_the_hand_written_ones():
    """Every key written by hand before is still there, generated (but the two of patch dropout's
    schedule), with its default and section. Catches a field renamed without ``Key(name=...)``
    keeping its key, a changed default, a key moved to another section or lost."""
    keys = _vit_keys()
    assert {k: keys.get(k) for k in HAND_WRITTEN} == HAND_WRITTEN
    generated = set(model_vit.REFERENCE) | set(tokens.REFERENCE)
    assert generated == set(keys) - {"VIT.PATCH_DROP_SCHEDULE", "VIT.PATCH_DROP_OFF_EPOCH"}


def test_the_value_tables_hold_the_hand_written_rows():
    """The tables of the keys written by hand before hold their rows as they were (a new
    option's rows come on top, and a key's new values after its old ones: VIT.FFN swiglu)."""
    for section, choices in ((model_vit, HAND_CHOICES), (tokens, HAND_TOKEN_CHOICES)):
        got = {k: section.CHOICES.get(k, ())[: len(v)] for k, v in choices.items()}
        assert got == choices
    sizes = ("DEPTH", "MLP_DIM", "NUM_HEADS", "PATCH_SIZE", "WIDTH")
    assert {f"VIT.{k}" for k in sizes} <= set(model_vit.POSITIVE)
    rates = {"VIT.ATTN_DROPOUT", "VIT.DROPOUT", "VIT.DROP_PATH"}
    assert rates <= set(model_vit.BELOW_ONE)
    others = {"VIT.CHECKPOINT_BLOCKS", "VIT.HEAD_INIT_SCALE", "VIT.NORM_EPS", "VIT.NUM_REGISTERS"}
    assert rates | others <= set(model_vit.NON_NEGATIVE)
    token_keys = {"TRAIN.TOKEN_BUDGET", "VIT.PATCH_DROP", "VIT.PATCH_DROP_OFF_EPOCH"}
    assert token_keys <= set(tokens.NON_NEGATIVE) and "VIT.PATCH_DROP" in tokens.BELOW_ONE


def test_each_section_checks_every_key_it_takes_of_a_record():
    """Each section that declares a record's keys holds their whole part: its tree's keys, every
    row of the value tables and features the record gives it (a table the section forgets to take
    would leave its keys unchecked)."""
    for record in RECORDS:
        owners = {k.owner for k in record.keys.values()}
        for owner in owners:
            section, part = getattr(sections, owner), record.section(owner)
            assert part.choices.items() <= getattr(section, "CHOICES", {}).items(), owner
            keys = {name: key for name, (key, _) in getattr(section, "FEATURES", {}).items()}
            assert {name: key for name, (key, _) in part.features.items()}.items() <= keys.items()
            for table in ("POSITIVE", "NON_NEGATIVE", "BELOW_ONE", "FRACTIONS"):
                mine = getattr(part, table.lower())
                assert set(mine) <= set(getattr(section, table, ())), (owner, table)
            assert part.reference.items() <= section.REFERENCE.items()
            assert set(_leaves(part.tree)) <= set(_leaves(section._C))


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_the_argument_table_reads_what_the_hand_written_rows_read():
    """Each row of VIT_ARGS gives the argument from the keys it always read (the resume check
    compares them): another section's key, a renamed key, a list as a tuple, an ``auto``
    resolved, two keys for the class token."""
    keyless = {"in_channels"}
    assert set(model_vit.VIT_ARGS) == set(options_of(VitArgs)) - keyless
    c = config.load_cfg(QUICKSTART, ["VIT.STEM_TYPE", "conv", "VIT.C_STEM_STRIDES", "[2, 2, 1, 1]",
                                     "VIT.CLASSIFIER", "pooled", "VIT.CLASS_TOKEN", "True"],
                        for_this_machine=False)  # fmt: skip
    args = model_vit.vit_arguments(c)
    assert args["image_size"] == c.TRAIN.IM_SIZE and args["num_classes"] == c.MODEL.NUM_CLASSES
    assert args["stem"] == "conv" and args["conv_stem_strides"] == (2, 2, 1, 1)
    assert args["class_token"] is True and args["packed_attention"] == "sdpa"  # auto: elsewhere
    assert args["residual_dtype"] == c.AMP.RESIDUAL_DTYPE
    read = {arg: keys_read(row, c) for arg, row in model_vit.VIT_ARGS.items()}
    assert read["image_size"] == {"TRAIN.IM_SIZE"} and read["stem"] == {"VIT.STEM_TYPE"}
    assert read["class_token"] == {"VIT.CLASSIFIER", "VIT.CLASS_TOKEN"}
    assert read["residual_dtype"] == {"AMP.RESIDUAL_DTYPE"}
    assert read["patch_drop"] == {"VIT.PATCH_DROP"}
    VitArgs(**args).check()


def test_the_features_the_fields_declare():
    """The engine x feature rule's ViT features come from their fields, keyed by their keys, and
    count only for a ViT (a CNN's config ignores VIT.DIST_TOKEN)."""
    keys = {name: key for name, (key, _) in FEATURES.items()}
    assert keys["distillation token"] == "VIT.DIST_TOKEN"
    assert keys["attention backend"] == "VIT.ATTENTION_BACKEND"
    assert keys["patch dropout"] == "VIT.PATCH_DROP"
    assert keys["drop-path skip"] == "VIT.DROP_PATH_MODE"
    c = config.get_default_cfg()
    on = lambda name: FEATURES[name][1](c)  # noqa: E731
    assert not any(on(n) for n in keys if keys[n].startswith("VIT."))
    c.VIT.DIST_TOKEN, c.VIT.DROP_PATH_MODE = True, "skip"
    assert on("distillation token") and not on("drop-path skip")  # no drop path: nothing skipped
    c.VIT.DROP_PATH = 0.1
    assert on("drop-path skip")
    c.MODEL.TYPE = "anynet"
    assert not on("distillation token")


@pytest.mark.parametrize("name", [n for n, (_, o) in options_of(VitArgs).items() if o.choices])
def test_vitargs_checks_the_choices_its_fields_declare(name):
    """One owner per enum: the record refuses what its field's choices leave out, naming them,
    and the key's table is the same tuple (or, for an ``auto`` key, holds it)."""
    _, declared = options_of(VitArgs)[name]
    with pytest.raises(VitArgsError, match=f"unknown {name} 'bogus'") as err:
        VitArgs(**{name: "bogus"}).check()
    assert err.value.arg == name and repr(declared.choices[-1]) in str(err.value)
    key = model_vit.VIT_RECORD.keys.get(name)
    if key is not None:
        table = {**model_vit.CHOICES, **tokens.CHOICES, **amp.CHOICES}[key.key]
        assert set(declared.choices) <= set(table)


@pytest.mark.parametrize("name", [n for n, (_, o) in options_of(VitArgs).items() if o.bounds])
def test_vitargs_checks_the_bounds_its_fields_declare(name):
    _, declared = options_of(VitArgs)[name]
    bad = {"positive": 0, "non_negative": -1, "rate": 1.0, "fraction": 1.5}[declared.bounds]
    with pytest.raises(VitArgsError, match=f"{name} must be") as err:
        VitArgs(**{name: bad}).check()
    assert err.value.arg == name


# ------------------------------------------------------------------------------------------------ #
# A record of any group
# ------------------------------------------------------------------------------------------------ #


def _resolve(value, workers):
    return ("a" if workers else "b") if value == "auto" else value


@dataclasses.dataclass
class _Settings:
    workers: int = option(2, "Loader workers", bounds="non_negative")
    mode: str = option("fast", "How", choices=("fast", "slow"),
                       key=Key("OLD_MODE", why="an older name"), feature="slow mode")  # fmt: skip
    sizes: tuple[int, ...] = option((1, 2), "Sizes")
    device: str = option("cpu", "Where", key=ReadFrom("DEVICE"))
    seed: int = option(0, "Seed", key=NoKey("drawn per run"))
    rate: float = option(0.1, "Rate", bounds="rate",
                         key=Key("OTHER.RATE", owner="b", default=0.0, why="off here"))  # fmt: skip
    scale: float | None = option(None, "Scale; None: none", bounds="positive")
    pick: str = option("a", "Pick", choices=("a", "b"),
                       key=Key(default="auto", choices=("auto", "a", "b"), read=_resolve,
                               also_reads=("RUNX.WORKERS",), why="auto: a"))  # fmt: skip


def test_a_record_of_any_group_with_keys_elsewhere_and_none():
    rk = records.RecordKeys(_Settings, "RUNX", home="a")
    a, b = rk.section("a"), rk.section("b")
    assert a.tree == {"RUNX": {"WORKERS": 2, "OLD_MODE": "fast", "SIZES": [1, 2], "SCALE": None,
                               "PICK": "auto"}}  # fmt: skip
    assert b.tree == {"OTHER": {"RATE": 0.0}}
    assert a.choices == {"RUNX.OLD_MODE": ("fast", "slow"), "RUNX.PICK": ("auto", "a", "b")}
    assert a.non_negative == ["RUNX.WORKERS"] and a.positive == a.below_one == []  # None: unset
    assert b.non_negative == b.below_one == ["OTHER.RATE"]
    assert a.reference["RUNX.OLD_MODE"] == "How. Key: an older name"
    c = CfgNode({**a.tree, **b.tree, "DEVICE": "cuda"})
    assert rk.arguments_of(c) == dict(workers=2, mode="fast", sizes=(1, 2), device="cuda",
                                      rate=0.0, scale=None, pick="a")  # fmt: skip
    assert "seed" not in rk.arguments
    assert keys_read(rk.arguments["pick"], c) == {"RUNX.PICK", "RUNX.WORKERS"}
    assert keys_read(rk.arguments["device"], c) == {"DEVICE"}
    key, on = a.features["slow mode"]
    assert key == "RUNX.OLD_MODE" and not on(c)
    c.RUNX.OLD_MODE = "slow"
    assert on(c) and b.features == {}
    text = rk.markdown()
    assert (
        "| `RUNX.OLD_MODE` | `fast` | `fast`, `slow` | `mode` | How. Key: an older name |" in text
    )
    assert "`device` (`DEVICE`)" in text and "No key: `seed` (drawn per run)." in text


def test_a_key_that_differs_from_its_field_says_why():
    with pytest.raises(ValueError, match="says why"):
        option(1, "x", key=Key("OTHER"))
    with pytest.raises(ValueError, match="says why"):
        option(1, "x", key=Key(default=2))
    with pytest.raises(ValueError, match="says how"):
        option(1, "x", key=ReadFrom("A.B", "A.C"))
    with pytest.raises(ValueError, match="bounds 'odd'"):
        option(1, "x", bounds="odd")


def test_a_new_vit_option_is_its_field_alone():
    """A field added to VitArgs, and nothing else, gives its key, its default, its check, its
    row of the argument table and of the key reference."""
    qk = option("none", "A norm of each head's queries and keys", choices=("none", "layer"))
    extended = dataclasses.make_dataclass("Extended", [("qk_norm", str, qk)], bases=(VitArgs,))
    rk = records.RecordKeys(extended, "VIT", home="model_vit")
    part = rk.section("model_vit")
    assert part.tree.VIT.QK_NORM == "none" and part.choices["VIT.QK_NORM"] == ("none", "layer")
    c = CfgNode({"VIT": {"QK_NORM": "layer"}})
    assert rk.arguments["qk_norm"](c) == "layer"
    assert "| `VIT.QK_NORM` | `none` | `none`, `layer` | `qk_norm` |" in rk.markdown()
    with pytest.raises(VitArgsError, match="unknown qk_norm 'rms'"):
        extended(qk_norm="rms").check()


# ------------------------------------------------------------------------------------------------ #
# The key reference
# ------------------------------------------------------------------------------------------------ #


def test_the_vit_key_reference_of_the_docs_is_the_fields_text():
    """Catches a field's meaning, default or values changed without the page (regenerate it:
    docs/changing_pycls.md)."""
    with open(os.path.join(ROOT, "docs", "configs.md")) as f:
        page = f.read()
    assert key_reference(page) == page, "regenerate with pycls.config.sections.key_reference"
    assert "| `VIT.STEM_TYPE` | `patchify` | `patchify`, `conv` | `stem` |" in page
    with pytest.raises(ValueError, match="has no markers"):
        key_reference("a page without them")
