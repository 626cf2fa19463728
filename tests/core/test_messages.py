"""Messages that once contradicted themselves or the machine, each corrected, each a row here:
what the message must say for the case, and the contradiction it must not. (The loader-bound
line said once: tests/datasets/loading/test_loader_wait.py; worker counts above the CPUs:
tests/config/test_config_machine.py.)"""

import sys

import pytest

from pycls import __main__ as pycls_main
from pycls import config
from pycls import distributed as dist
from pycls.core import run_advice
from tests.helpers import QUICKSTART


def _config_error(*overrides):
    with pytest.raises(config.ConfigError) as caught:
        config.read_cfg(QUICKSTART, list(overrides))
    return str(caught.value)


def _one_pass_needs_only_what_is_missing():
    """ "needs OPTIM.OPTIMIZER adamw (not adamw)" to a run that had adamw."""
    return _config_error("OPTIM.ONE_PASS", "True", "OPTIM.CONTIGUOUS_PARAMS", "False")


def _a_value_of_the_wrong_type_is_a_sentence():
    """yacs's "Type mismatch (<class 'float'> vs. <class 'str'>)" where a sentence belongs."""
    return _config_error("OPTIM.BASE_LR", "fast")


def _divergence_advice(level, dtype):
    cfg = config.read_cfg(QUICKSTART, ["AMP.LEVEL", level, "AMP.DTYPE", dtype])
    return run_advice.divergence_advice(cfg)


_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"}

# name -> (the message, what it must say, what it must not)
ROWS = {
    "ONE_PASS's needs": (
        _one_pass_needs_only_what_is_missing,
        ["OPTIM.ONE_PASS: is AdamW's step", "needs OPTIM.CONTIGUOUS_PARAMS True (now False)"],
        ["adamw (not adamw)", "OPTIM.OPTIMIZER"],
    ),
    "a wrong type": (
        _a_value_of_the_wrong_type_is_a_sentence,
        ["OPTIM.BASE_LR: takes a number, got text: 'fast'"],
        ["Type mismatch", "<class"],
    ),
    "a NaN at O1": (
        lambda: _divergence_advice("O1", "bfloat16"),
        ["a lower OPTIM.BASE_LR", "OPTIM.CLIP_GRAD"],
        ["AMP.LEVEL O1", "bfloat16"],
    ),
    "a NaN at O2": (lambda: _divergence_advice("O2", "bfloat16"), ["AMP.LEVEL O1"], ["O2"]),
    "a NaN at O1 in float16": (
        lambda: _divergence_advice("O1", "float16"),
        ["AMP.DTYPE bfloat16"],
        ["AMP.LEVEL O1"],
    ),
    "the store variable already set": (
        lambda: dist.agent_store_advice({**_STORE, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
        ["is set, but torchrun's static rendezvous", "--rdzv-backend c10d"],
        ["set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for"],
    ),
    "the store variable not set": (
        lambda: dist.agent_store_advice(_STORE),
        ["set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun", "--rdzv-backend c10d"],
        ["is set"],
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_a_message_fits_the_config_and_the_machine(row):
    """Broke on each row's case before it was corrected (the row's function says the old
    words): every phrase it must say is there, and none it must not."""
    make, says, never = ROWS[row]
    text = make()
    assert all(s in text for s in says), text
    assert not any(n in text for n in never), text


def test_sweep_setup_from_the_pycls_command_names_the_next_step_as_pycls(
    tmp_path, capsys, monkeypatch
):
    """Broke when `pycls sweep-setup` (from a wheel: no tools/ folder) told the user to run
    `python tools/sweep_launch.py`: the next step is named as the user runs the steps, with the
    same overrides."""
    argv = [
        "sweep-setup",
        "--sweep-cfg",
        "configs/sweeps/quickstart_lr.yaml",
        "ROOT_DIR",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/pycls", *argv])  # the console command
    with pytest.raises(SystemExit) as caught:
        pycls_main.main(argv)
    out = capsys.readouterr().out
    assert caught.value.code == 0
    sweep = "configs/sweeps/quickstart_lr.yaml"
    want = f"next: pycls sweep-launch --sweep-cfg {sweep} ROOT_DIR {tmp_path}"
    assert want in out, out
    assert "tools/" not in out
