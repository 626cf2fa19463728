"""Config files and overrides that are wrong: each a one-line config error naming the key, exit
status 2, at load time (non-finite numbers, empty files, a directory, a nested class list, a key
written twice in a section), and YAML tags that would run code execute nothing."""

from pathlib import Path

import pytest

from pycls import config
from pycls.core import cli
from tests.helpers import (
    QUICKSTART,
    TINY,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_yaml_tags_execute_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f'OUT_DIR: !!python/object/apply:os.system ["touch {marker}"]\n')
    assert cli.main(["--mode", "info", "--cfg", str(cfg_file)]) == 2
    assert "cannot parse" in capsys.readouterr().err and not marker.exists()


@pytest.mark.parametrize(
    "yaml_text, overrides, match",
    [
        (None, ["TRAIN.ACCUM_STEPS", "0"], "TRAIN.ACCUM_STEPS: must be > 0"),
        ("OPTIM:\n  BASE_LR: .inf\n", [], "OPTIM.BASE_LR: must be a finite number"),
        ("OPTIM:\n  BETAS: [0.9, .nan]\n", [], "OPTIM.BETAS: must be a finite number"),
        (None, ["OPTIM.EPS", "1e400"], "OPTIM.EPS: must be a finite number"),
        ("# nothing\n", [], "is empty"),
        ("DIR", [], "is a directory"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, capsys, yaml_text, overrides, match):
    cfg_file = QUICKSTART
    if yaml_text == "DIR":
        cfg_file = str(tmp_path)
    elif yaml_text is not None:
        cfg_file = str(tmp_path / "c.yaml")
        Path(cfg_file).write_text(yaml_text)
    with pytest.raises(config.ConfigError, match=match):
        config.load_cfg(cfg_file, overrides)
    assert cli.main(["--mode", "info", "--cfg", cfg_file, *overrides]) == 2
    assert match in capsys.readouterr().err


def test_nested_class_list_is_a_one_line_config_error(capsys):
    overrides = [*TINY, "DATA.CLASSES", "[[1, 2], [3]]"]
    with pytest.raises(config.ConfigError, match=r"^DATA.CLASSES: holds \[1, 2\], but its"):
        config.load_cfg(QUICKSTART, overrides)
    assert cli.main(["--mode", "info", "--cfg", QUICKSTART, *overrides]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "config error: DATA.CLASSES: holds [1, 2], but its values are numbers"


def test_a_key_written_twice_in_a_yaml_file_names_the_key_and_both_lines(tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "OPTIM:\n  BASE_LR: 0.1\n  MAX_EPOCH: 2\n  BASE_LR: 0.5\nVIT:\n  DEPTH: 1\n"
    )
    assert cli.main(["--mode", "info", "--cfg", str(cfg_file)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"config error: --cfg: {cfg_file}: key 'BASE_LR' appears twice in one section "
        "(lines 2 and 4); keep one"
    )
    # The same key in two sections is two keys
    cfg_file.write_text("OPTIM:\n  MAX_EPOCH: 2\nCURRICULUM:\n  MAX_EPOCH: 0\n")
    with pytest.raises(config.ConfigError, match="CURRICULUM.MAX_EPOCH"):  # (not a key there)
        config.load_cfg(str(cfg_file))
