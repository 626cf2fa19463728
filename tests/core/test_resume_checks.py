"""A resume refuses every change of a key that shapes the model, in one line naming it; the keys
are derived from the builders' argument tables, so a new model argument cannot be forgotten."""

import pytest

from pycls import config
from pycls.checkpoint.resume import IncompatibleCheckpointError
from pycls.core import builders, cli, resume_checks
from tests.helpers import QUICKSTART, TINY

# Keys a hand-kept list once missed; each changes the parameters' names or shapes
SHAPING = {
    "VIT.CLASS_TOKEN": ("False", "True"),
    "VIT.NUM_REGISTERS": ("0", "4"),
    "VIT.QKV_BIAS": ("True", "False"),
    "VIT.PRE_NORM": ("False", "True"),
    "VIT.FC_NORM": ("False", "True"),
    "VIT.FFN": ("mlp", "local"),
    "MODEL.NUM_CLASSES": ("10", "12"),
}
POOLED = ["VIT.CLASSIFIER", "pooled"]  # CLASS_TOKEN matters beside the pooled classifier


def _cfg(*overrides):
    return config.load_cfg(QUICKSTART, [*TINY, *POOLED, *overrides])


@pytest.mark.parametrize("key", sorted(SHAPING))
def test_a_changed_shaping_key_is_refused_naming_it(key):
    before, after = SHAPING[key]
    stored, now = _cfg(key, before), _cfg(key, after)
    with pytest.raises(IncompatibleCheckpointError, match=rf"{key}: .* -> "):
        resume_checks.check_compatible("ckpt.pyth", {"cfg": stored.dump()}, now)


@pytest.mark.parametrize(
    "key, value",
    [
        ("VIT.DROP_PATH", "0.1"),
        ("VIT.DROPOUT", "0.1"),
        ("TRAIN.IM_SIZE", "32"),
        ("OPTIM.BASE_LR", "0.5"),
        ("VIT.ATTENTION_BACKEND", "math"),  # a kernel: the weights mean the same
    ],
)
def test_training_only_keys_may_change(key, value):
    resume_checks.check_compatible("ckpt.pyth", {"cfg": _cfg().dump()}, _cfg(key, value))


def test_a_key_that_leaves_every_argument_as_it_was_may_change():
    """VIT.CLASS_TOKEN under the token classifier (which always has a class token) builds the
    same model: a resume under another value is accepted (refused when the check compared every
    key the argument's row reads, not the argument), while the same key with the pooled
    classifier still changes the model and is refused."""
    token = ("VIT.CLASSIFIER", "token")
    stored = {"cfg": _cfg(*token).dump()}
    resume_checks.check_compatible("ckpt.pyth", stored, _cfg(*token, "VIT.CLASS_TOKEN", "True"))
    pooled = {"cfg": _cfg().dump()}
    with pytest.raises(IncompatibleCheckpointError, match="VIT.CLASS_TOKEN"):
        resume_checks.check_compatible("ckpt.pyth", pooled, _cfg("VIT.CLASS_TOKEN", "True"))


def test_the_residual_stream_and_float8_layers_may_change_on_resume():
    """The residual stream's dtype and the float8 layers change how the same weights compute,
    not what they are: a run may resume under other values of either."""
    stored = _cfg("AMP.LEVEL", "O1").dump()
    for overrides in (
        ["AMP.LEVEL", "O1", "AMP.RESIDUAL_DTYPE", "bfloat16"],
        ["AMP.FLOAT8", "tensorwise", "AMP.FLOAT8_LAYERS", "mlp", "AMP.FLOAT8_MIN_DIM", "0"],
    ):
        resume_checks.check_compatible("ckpt.pyth", {"cfg": stored}, _cfg(*overrides))


def test_the_shaping_keys_are_what_the_builders_read():
    keys = builders.model_keys(_cfg())
    assert set(SHAPING) <= set(keys)
    assert not {"VIT.DROP_PATH", "VIT.DROPOUT", "TRAIN.IM_SIZE", "VIT.LAYOUT"} & set(keys)
    # every key that shapes the model changes the parameters' names or shapes
    for key, (before, after) in SHAPING.items():
        a = builders.build_model(_cfg(key, before)).state_dict()
        b = builders.build_model(_cfg(key, after)).state_dict()
        assert {k: v.shape for k, v in a.items()} != {k: v.shape for k, v in b.items()}, key


def test_a_resume_with_a_changed_qkv_bias_ends_in_one_line(tmp_path, capsys):
    """End to end: before, the changed key reached load_state_dict and ended in its traceback."""
    run = ["--mode", "train", "--cfg", QUICKSTART, *TINY, "OUT_DIR", str(tmp_path)]
    run += ["OPTIM.MAX_EPOCH", "1", "DATA_LOADER.NUM_WORKERS", "0"]
    assert cli.main(run) == 0
    capsys.readouterr()
    assert cli.main([*run, "OPTIM.MAX_EPOCH", "2", "VIT.QKV_BIAS", "False"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "VIT.QKV_BIAS: True -> False" in lines[0] and "TRAIN.WEIGHTS" in lines[0]


@pytest.mark.usefixtures("single_thread")
def test_a_changed_cnn_architecture_key_is_refused_on_resume():
    """A CNN's shape comes from its family's keys (REGNET.W0 ...), not the VIT ones."""
    stored = config.load_cfg(None, ["MODEL.TYPE", "regnet", "REGNET.W0", "24"])
    now = config.load_cfg(None, ["MODEL.TYPE", "regnet", "REGNET.W0", "32"])
    with pytest.raises(IncompatibleCheckpointError, match=r"REGNET\.W0: 24 -> 32"):
        resume_checks.check_compatible("ckpt.pyth", {"cfg": stored.dump()}, now)
    resume_checks.check_compatible("ckpt.pyth", {"cfg": now.dump()}, now)  # unchanged: fine
