"""Upper bounds on keys that had none, each derived from what the value allocates or how long it
takes, checked when the config loads with the reason (their sections; the machine's memory in
pycls.config.machine):
TRAIN.TOKEN_BUDGET and DATA_LOADER.SHUFFLE_BUFFER against this machine's memory, MUON.NS_STEPS
by when the iteration has nothing left to do, DATA_LOADER.RETRIES by how long a failing read
waits, VIT.PATCH_DROP_OFF_EPOCH by the run's length. The largest value allowed loads."""

import math

import pytest
import torch

from pycls import config
from pycls.config import machine
from pycls.core import cli
from pycls.datasets.transport import http_files, read_deadlines, remote_files, url_policy
from pycls.optim.muon import NS_COEFFICIENTS, orthogonalize
from pycls.optim.newton_schulz import BFLOAT16_TINY, max_ns_steps
from tests.helpers import QUICKSTART


def _refused(key, value, *extra):
    with pytest.raises(config.ConfigError) as err:
        config.load_cfg(QUICKSTART, [key, str(value), *extra])
    line = str(err.value)
    assert line.startswith(f"{key}: ") and "\n" not in line, line
    return line


def _loads(key, value, *extra):
    return config.get(config.load_cfg(QUICKSTART, [key, str(value), *extra]), key)


def test_ns_steps_past_the_iterations_reach_are_refused():
    most = max_ns_steps()
    assert torch.finfo(torch.bfloat16).tiny == BFLOAT16_TINY  # the torch-free bound's constant
    assert most == math.ceil(126 * math.log(2) / math.log(NS_COEFFICIENTS[0])) == 71
    assert "after 71 every singular value" in _refused("MUON.NS_STEPS", 10**8)
    assert _loads("MUON.NS_STEPS", most) == most
    # The derivation: a singular value near bfloat16's smallest normal number (a diagonal
    # matrix: no rounding of other entries lifts it) reaches the band in 71 steps, not in 35
    m = torch.zeros(2, 8)
    m[0, 0], m[1, 1] = 1.0, torch.finfo(torch.bfloat16).tiny * 4
    smallest = lambda k: torch.linalg.svdvals(orthogonalize(m, k).float()).min()  # noqa: E731
    assert smallest(most) > 0.5 and smallest(most // 2) < 1e-10


def test_retries_that_would_wait_more_than_a_day_are_refused():
    line = _refused("DATA_LOADER.RETRIES", 10**9)
    assert "years before the run says so" in line and "at most 724 keep it under a day" in line
    assert _loads("DATA_LOADER.RETRIES", 724) == 724
    _refused("DATA_LOADER.RETRIES", 725)
    # The wait as http_files pauses: 0.2 s doubling up to 60 s (9 pauses to 51.2 s, then 60 s),
    # 60 s of silence each attempt
    pauses = sum(0.2 * 2**k for k in range(9)) + 60 * (724 - 1 - 9)
    assert url_policy.read_wait_s(724) == pytest.approx(724 * 60 + pauses)
    assert url_policy.read_wait_s(724) <= 24 * 3600 < url_policy.read_wait_s(725)


def test_the_pause_between_attempts_doubles_up_to_a_minute(monkeypatch):
    assert [http_files.retry_pause(n) for n in range(1, 13)] == pytest.approx(
        [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2, 60, 60, 60]
    )
    assert http_files.retry_pause(10**6) == 60
    assert http_files.total_pause(1) == 0 and http_files.total_pause(12) == pytest.approx(222.2)
    # What a failing read waits, as attempt() pauses it (a pause a stop signal would end)
    slept = []
    monkeypatch.setattr(read_deadlines, "pause", lambda seconds, what: slept.append(seconds))

    def refused():
        raise ConnectionRefusedError

    with pytest.raises(remote_files.DataReadError, match="after 14 attempts: connection refused"):
        http_files.attempt(refused, "x", "http://127.0.0.1:9/x", 14)
    assert slept == pytest.approx([http_files.retry_pause(n) for n in range(1, 14)])
    assert max(slept) == 60 and sum(slept) == pytest.approx(http_files.total_pause(14))


def test_a_patch_drop_off_epoch_the_run_never_reaches_is_refused():
    extra = ["VIT.PATCH_DROP", "0.5", "OPTIM.MAX_EPOCH", "40"]
    assert "is never reached in a run of OPTIM.MAX_EPOCH 40" in _refused(
        "VIT.PATCH_DROP_OFF_EPOCH", 10**5, *extra
    )
    _refused("VIT.PATCH_DROP_OFF_EPOCH", 40, *extra)
    assert _loads("VIT.PATCH_DROP_OFF_EPOCH", 39, *extra) == 39


def _sized(memory, *overrides):
    c = config.load_cfg(QUICKSTART, list(overrides), for_this_machine=False)
    c.defrost()
    machine.check_sizes(c, memory=memory)


def test_a_token_budget_whose_micro_batch_cannot_fit_in_memory_is_refused():
    """10^12 tokens asked for 16 TB in --mode info; the bound is the machine's memory: one
    micro-batch's patches as float pixels (4x4x3x4 bytes a patch here)."""
    budget = ["TRAIN.TOKEN_BUDGET"]
    line = _refused("TRAIN.TOKEN_BUDGET", 10**12)
    assert "more than this machine's" in line and "TB a micro-batch" in line
    gib = 1 << 30
    fits = gib // (4 * 4 * 3 * 4)  # a micro-batch of this many patches is 1 GiB of pixels
    _sized(gib, *budget, str(fits))
    with pytest.raises(config.ConfigError, match="TRAIN.TOKEN_BUDGET: .* more than this machine"):
        _sized(gib, *budget, str(fits + 16))
    # Shared by processes and accumulation steps: each micro-batch is a quarter
    _sized(gib, *budget, str(4 * fits), "NUM_PROCS", "2", "TRAIN.ACCUM_STEPS", "2")


def test_a_shuffle_buffer_larger_than_any_split_this_machine_can_order_is_refused():
    line = _refused("DATA_LOADER.SHUFFLE_BUFFER", 10**14)
    assert "more than any split this machine can order" in line
    _sized(8 << 20, "DATA_LOADER.SHUFFLE_BUFFER", str(1 << 20))
    with pytest.raises(config.ConfigError, match="DATA_LOADER.SHUFFLE_BUFFER"):
        _sized(8 << 20, "DATA_LOADER.SHUFFLE_BUFFER", str((1 << 20) + 1))


def test_info_with_a_token_budget_of_ten_to_the_twelve_is_one_line_exit_2(capsys):
    status = cli.main(
        ["--mode", "info", "--cfg", QUICKSTART, "TRAIN.TOKEN_BUDGET", "10" + "0" * 11]
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and line.startswith("config error: TRAIN.TOKEN_BUDGET: 1000000000000")
