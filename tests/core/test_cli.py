"""The command line: user mistakes end in one line on stderr and exit status 2, no traceback."""

import errno
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from pycls import config, signals
from pycls.checkpoint import single_file as checkpoint
from pycls.checkpoint.files import CheckpointWriteError, CorruptFileError
from pycls.checkpoint.run_lock import RunLockedError
from pycls.checkpoint.unpickle import UnsafePickleError
from pycls.checkpoint.weight_files import WeightsError
from pycls.core import builders, cli, command_line
from pycls.datasets import Digits
from pycls.datasets.formats.imagefolder import CorruptImageError
from pycls.datasets.loading.checks import ClassMismatchError
from pycls.distributed import launch, process_groups
from pycls.errors import EnvironmentFailure, UserError
from pycls.models import VisionTransformer
from pycls.models.zoo import PretrainedWeightsUnavailable
from tests.helpers import QUICKSTART, ROOT, TINY, json_stats_of, processes, scaled, tiny_quickstart
from tests.helpers.warm import run as warm_run


def _run_cli(capsys, *args):
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def _assert_one_line(status, err, *words):
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    assert "Traceback" not in err


def test_test_mode_without_weights_is_one_line_and_prints_no_config(capsys, tmp_path):
    status, out, err = _run_cli(
        capsys, "--mode", "test", "--cfg", QUICKSTART, "OUT_DIR", str(tmp_path)
    )
    _assert_one_line(status, err, "config error: TEST.WEIGHTS", "--mode test needs")
    assert out == ""  # stops before the run starts: no config dump
    missing = str(tmp_path / "nope.pyth")
    status, _, err = _run_cli(
        capsys, "--mode", "test", "--cfg", QUICKSTART, "TEST.WEIGHTS", missing
    )
    _assert_one_line(status, err, "TEST.WEIGHTS", missing, "does not exist")


def test_missing_data_folder_names_the_key(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    opts = ["TRAIN.DATASET", "imagefolder", "DATA.PATH", str(empty), "OUT_DIR", str(tmp_path)]
    status, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *TINY, *opts)
    _assert_one_line(status, err, "config error: DATA.PATH", str(empty))


def test_checkpoint_that_does_not_fit_is_one_line(capsys, tmp_path):
    other = VisionTransformer(
        image_size=16, patch_size=4, depth=2, width=48, num_heads=3, mlp_dim=64, num_classes=10
    )
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    path = checkpoint.save_checkpoint(str(tmp_path), 1, model=other, optimizer=opt, cfg_yaml="")
    opts = ["TEST.WEIGHTS", path, "OUT_DIR", str(tmp_path / "test")]
    status, _, err = _run_cli(capsys, "--mode", "test", "--cfg", QUICKSTART, *TINY, *opts)
    _assert_one_line(status, err, "error: checkpoint", path, "does not fit", "first:")
    assert "size mismatch" not in err


@pytest.mark.slow  # about 15 s on 2 idle cores: two spawned processes
def test_exit_status_and_one_line_from_spawned_processes(tmp_path):
    """run_net.py itself with two spawned processes: the error arises in the children and the
    parent prints it once."""
    num_procs = "2"
    # a folder that is there (one that is not is answered before any process starts) without
    # the train/ the reader looks for
    (tmp_path / "none").mkdir()
    opts = ["TRAIN.DATASET", "imagefolder", "DATA.PATH", str(tmp_path / "none")]
    cmd = [sys.executable, os.path.join(ROOT, "tools", "run_net.py"), "--mode", "train"]
    cmd += ["--cfg", QUICKSTART, *TINY, *opts, "OUT_DIR", str(tmp_path), "NUM_PROCS", num_procs]
    cmd += ["TRAIN.PARALLEL", "ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = warm_run(cmd, env=env, timeout=scaled(300))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"config error: DATA.PATH: image folder not found: {tmp_path / 'none' / 'train'} "
        "(imagefolder, split 'train')"
    ], p.stderr


def test_amp_level_on_the_cpu_follows_its_measured_bfloat16_speed_and_says_so(
    capsys, monkeypatch, tmp_path
):
    from pycls.engines import cpu_amp  # where the CPU's probe is measured

    ran = {}
    monkeypatch.setattr(launch, "launch", lambda fn, settings, mode, cfg: ran.update(cfg=cfg))
    opts = ["AMP.LEVEL", "O1", "DEVICE", "cpu", "OUT_DIR", str(tmp_path)]
    monkeypatch.setattr(cpu_amp, "measure_cpu_bf16", lambda: (0.010, 0.012))  # bf16 slower
    status, out, _ = _run_cli(capsys, "--mode", "time", "--cfg", QUICKSTART, *opts)
    assert status == 0 and ran["cfg"].AMP.LEVEL == "O0"
    assert "note: AMP.LEVEL O1 runs as O0 on the CPU (a transformer MLP step measured" in out
    assert "10.00 ms in fp32 and 12.00 ms in bfloat16" in out and "AMP.CPU_LEVEL same" in out
    status, out, _ = _run_cli(
        capsys, "--mode", "time", "--cfg", QUICKSTART, *opts, "AMP.CPU_LEVEL", "same"
    )
    assert status == 0 and ran["cfg"].AMP.LEVEL == "O1" and "note" not in out
    monkeypatch.setattr(cpu_amp, "measure_cpu_bf16", lambda: (0.020, 0.010))  # bf16 2x faster
    status, out, _ = _run_cli(capsys, "--mode", "time", "--cfg", QUICKSTART, *opts)
    assert status == 0 and ran["cfg"].AMP.LEVEL == "O1"
    assert "note: AMP.LEVEL O1 (bfloat16) runs as is: a transformer MLP step measured" in out
    # the config the run records is the one that runs
    assert (ran["cfg"].AMP.CPU_LEVEL, ran["cfg"].DEVICE) == ("same", "cpu")


def test_a_run_prints_only_the_keys_that_differ_from_the_defaults(capsys, tmp_path):
    from pycls import config
    from pycls.core import trainer

    cfg = config.load_cfg(QUICKSTART, [*TINY, "OUT_DIR", str(tmp_path)])
    trainer.setup_env(cfg)
    out = capsys.readouterr().out
    assert "VIT.DEPTH: 1" in out and "OPTIM.MAX_EPOCH: 40" in out
    assert "PREFETCH_FACTOR" not in out and "NORM_EPS" not in out  # defaults stay quiet
    assert len(out.splitlines()) < 40
    assert config.load_cfg(str(tmp_path / "config.yaml")) == cfg  # the whole config is there


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_cuda_is_one_line(capsys, tmp_path):
    opts = ["DEVICE", "cuda", "OUT_DIR", str(tmp_path)]
    status, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *TINY, *opts)
    _assert_one_line(status, err, "config error: DEVICE: 'cuda' was asked for")


@pytest.mark.parametrize("rank", [0, 1])
def test_under_a_launcher_a_config_error_is_printed_by_the_first_process_only(
    capsys, monkeypatch, tmp_path, rank
):
    """torchrun and srun start every process with the same config: one line in all, not one per
    process. An error raised once the run started may be one process's own: it names the rank."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    status, _, err = _run_cli(capsys, "--mode", "test", "--cfg", QUICKSTART)
    if rank == 0:
        _assert_one_line(status, err, "config error: TEST.WEIGHTS")
    else:
        assert status == 2 and err == ""

    def fail(fn, settings, mode, cfg):
        raise UserError("shard 3 of /data/train is corrupt")

    monkeypatch.setattr(launch, "launch", fail)
    opts = ["DEVICE", "cpu", "OUT_DIR", str(tmp_path)]
    status, _, err = _run_cli(capsys, "--mode", "time", "--cfg", QUICKSTART, *opts)
    prefix = "" if rank == 0 else "[rank 1] "
    assert status == 2 and err == f"{prefix}error: shard 3 of /data/train is corrupt\n", err


@pytest.mark.parametrize("num_workers", ["0", "1"])
def test_corrupt_image_is_one_line_naming_the_skip_key(capsys, tmp_path, num_workers):
    """Also from a loader worker, whose traceback torch hands over as the error's message; the
    worker has ended by the time the run returns (it lived on while the error's traceback held
    the loader: until 2026-11-27, until the next garbage collection)."""
    from PIL import Image

    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(
                    tmp_path / "data" / split / name / f"{i}.png"
                )
    bad = tmp_path / "data" / "train" / "b" / "2.png"
    bad.write_bytes(b"not a png at all")
    opts = ["DATA.PATH", str(tmp_path / "data"), "DATA_LOADER.NUM_WORKERS", num_workers]
    opts += ["TRAIN.BATCH_SIZE", "4", "OPTIM.MAX_EPOCH", "1", "OUT_DIR", str(tmp_path / "out")]
    before = set(processes.owned())
    status, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *TINY, *opts)
    assert status == 2  # a bad input file: the user's to fix (pycls.errors: exit statuses)
    assert processes.still_running(set(processes.owned()) - before) == {}
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: cannot decode image {bad}"), line
    assert "DATA_LOADER.SKIP_CORRUPT True" in line and "Traceback" not in err


def test_a_loader_worker_killed_mid_epoch_is_one_line_naming_it_and_its_signal(
    capsys, monkeypatch, tmp_path
):
    """Broke when a loader worker killed mid-epoch (the out-of-memory killer, kill -9) ended the
    run with torch's traceback ending in a bare EOFError or ECONNRESET, naming no worker: one
    line naming the worker, its pid and its signal, exit status 1 (the machine's), no worker
    left running."""
    real = Digits.__getitem__

    def killed_at_sample_7(self, index):
        if index == 7 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
            time.sleep(1)  # (lands before the sample is returned)
        return real(self, index)

    monkeypatch.setattr(Digits, "__getitem__", killed_at_sample_7)
    opts = ["DATA_LOADER.NUM_WORKERS", "2", "OPTIM.MAX_EPOCH", "1", "OUT_DIR", str(tmp_path)]
    before = set(processes.owned())
    status, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *TINY, *opts)
    assert processes.still_running(set(processes.owned()) - before) == {}
    (line,) = err.strip().splitlines()
    assert status == 1 and re.fullmatch(
        r"error: data loader worker \d of [12] \(pid \d+\) was killed by SIGKILL .* mid-epoch: "
        r"the run stops here; rerun the same command to resume .*", line), line  # fmt: skip


def test_a_full_disk_at_start_names_its_file_and_nothing_claims_one_unwritten(
    capsys, monkeypatch, tmp_path
):
    """Broke when a full disk at start ended in "No space left on device" naming no file after
    the log had pointed to a config.yaml never written: a disk full from the start is found by
    the OUT_DIR check (exit 1, naming OUT_DIR); one that fills as config.yaml is written names
    config.yaml, and the log claims it only once written."""
    from pycls import atomic_files

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "run"
    monkeypatch.setattr(cli.os, "fsync", full)
    status, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, "OUT_DIR", str(out))
    (line,) = err.strip().splitlines()
    assert status == 1 and line.startswith(f"error: cannot write to OUT_DIR {out}: No space left")
    monkeypatch.undo()
    real_open = open

    def full_for_config_yaml(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        if os.path.basename(path).startswith("config.yaml"):
            f.write = full
        return f

    monkeypatch.setattr(atomic_files, "open", full_for_config_yaml, raising=False)
    opts = [*TINY, "OPTIM.MAX_EPOCH", "1", "OUT_DIR", str(out)]
    status, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *opts)
    (line,) = err.strip().splitlines()
    assert status == 1 and line.startswith(f"error: {out / 'config.yaml'}: No space left"), line
    log = (out / "stdout.log").read_text()
    assert "config.yaml" not in log and not (out / "config.yaml").exists()
    assert sorted(os.listdir(out)) == ["stdout.log"]  # no lock left, no temporary file


def test_unwritable_out_dir_names_the_key(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a folder cannot be made inside a file, not even by root
    out_dir = str(blocker / "run")
    status, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, "OUT_DIR", out_dir)
    _assert_one_line(status, err, "config error: OUT_DIR: cannot write to", out_dir)


def test_help_lists_every_mode_and_points_at_the_config_reference(capsys):
    with pytest.raises(SystemExit):
        command_line.parse_args(["--help"])
    out = capsys.readouterr().out
    for mode, what in command_line.MODES.items():
        assert f"  {mode:<8} {what}" in out
    assert "pycls/config/sections/" in out and "dry run" in command_line.MODES["info"]


def test_info_is_a_dry_run_printing_the_resolved_config(capsys, tmp_path):
    out_dir = tmp_path / "never_made"
    opts = ["OPTIM.BASE_LR", "0.0042", "OUT_DIR", str(out_dir)]
    status, out, _ = _run_cli(capsys, "--mode", "info", "--cfg", "quickstart", *opts)
    assert status == 0
    assert "OPTIM.BASE_LR: 0.0042" in out and "VIT.DEPTH: 4" in out and "M params" in out
    assert not out_dir.exists()


def test_no_progress_bar_on_a_terminal_of_zero_columns(monkeypatch):
    from pycls.core import trainer

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "fileno", lambda: 2)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    assert trainer._progress(10, "train") is None
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((80, 24)))
    bar = trainer._progress(10, "train")
    assert bar is not None
    bar.close()


def test_run_folder_as_test_weights_uses_its_newest_checkpoint(capsys, tmp_path):
    from pycls.core import builders
    from tests.helpers import tiny_quickstart

    cfg = tiny_quickstart(tmp_path)
    run = tmp_path / "run"
    for epoch in (1, 2):
        torch.manual_seed(epoch)
        model = builders.build_model(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        checkpoint.save_checkpoint(str(run), epoch, model=model, optimizer=opt, cfg_yaml="")
    newest = checkpoint.get_checkpoint_path(str(run), 2)
    errors = {}
    for given in (str(run), str(run / "checkpoints"), newest):
        out_dir = str(tmp_path / f"test{len(errors)}")
        opts = ["TEST.WEIGHTS", given, "OUT_DIR", out_dir]
        status, out, err = _run_cli(capsys, "--mode", "test", "--cfg", QUICKSTART, *TINY, *opts)
        assert status == 0, err
        (line,) = [ln for ln in out.splitlines() if '"test_epoch"' in ln]
        errors[given] = line.split('"top1_err": ')[1].split(",")[0]
        if given != newest:
            assert (
                f"TEST.WEIGHTS: {given} is a folder: using its newest checkpoint, {newest}" in out
            )
    assert len(set(errors.values())) == 1, errors  # the same weights each time
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "model_final.safetensors").write_bytes(b"")
    opts = ["TEST.WEIGHTS", str(empty), "OUT_DIR", str(tmp_path / "t")]
    status, _, err = _run_cli(capsys, "--mode", "test", "--cfg", QUICKSTART, *TINY, *opts)
    _assert_one_line(status, err, f"TEST.WEIGHTS: {empty} is a folder holding no checkpoint")
    assert "its final weights are" in err and "give a checkpoint file" in err


@pytest.mark.parametrize("group", [True, False], ids=["had a process group", "never had one"])
def test_the_exit_keeps_the_status_and_flushes_what_was_printed(group):
    """A process that had a process group leaves without the interpreter's teardown (os._exit):
    its exit status and its buffered output must survive that."""
    code = (
        "import sys; from pycls import distributed as d\n"
        + ("d.init_single_process_group('cpu'); d.destroy_process_group()\n" if group else "")
        + "print('buffered', end=''); sys.stderr.write('and this'); d.exit_process(75)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120), cwd=ROOT
    )
    assert proc.returncode == 75, proc.stderr
    # gloo's own connection line (torch 2.10 prints it to stdout) is not the script's output
    lines = proc.stdout.splitlines(keepends=True)
    out = "".join(line for line in lines if not line.startswith("[Gloo] "))
    assert out == "buffered" and proc.stderr.endswith("and this")


def test_console_main_exits_with_mains_status(monkeypatch):
    """Errors (2), preemption's SystemExit(75) and --help (0) keep their status through the
    command's exit."""
    exits = []
    monkeypatch.setattr(cli.dist, "exit_process", lambda code, since: exits.append(code))
    cli.console_main(["--mode", "info", "--cfg", "no/such.yaml"])
    monkeypatch.setattr(cli, "main", lambda argv: (_ for _ in ()).throw(SystemExit(75)))
    cli.console_main([])
    monkeypatch.setattr(cli, "main", lambda argv: (_ for _ in ()).throw(SystemExit(None)))
    cli.console_main([])
    assert exits == [2, 75, 0]


def test_console_main_in_a_process_that_had_groups_before_raises_systemexit(monkeypatch):
    """A test runner (or any caller) that joined process groups earlier is not ended at once by
    a command that joined none: --help raises SystemExit(0) as a plain exit does."""
    monkeypatch.setattr(process_groups, "_groups_joined", process_groups.groups_joined() + 1)
    with pytest.raises(SystemExit) as e:
        cli.console_main(["--help"])
    assert e.value.code == 0


@pytest.mark.parametrize(
    "yaml_text, overrides, hint",
    [
        (
            "",
            ["OPTIM.BASE_LRR", "0.1"],
            "OPTIM.BASE_LRR: unknown config key (did you mean OPTIM.BASE_LR?)",
        ),
        ("OPTIM:\n  BASE_LRR: 0.1\n", [], "(did you mean OPTIM.BASE_LR?)"),
        ("OPTIMM:\n  BASE_LR: 0.1\n", [], "OPTIMM: unknown config key (did you mean OPTIM?)"),
        ("", ["train.im_size", "32"], "(did you mean TRAIN.IM_SIZE?)"),
        ("", ["NUM_GPU", "2"], "(did you mean NUM_GPUS?)"),  # upstream's key, translated
    ],
)
def test_unknown_keys_name_the_closest_known_key(capsys, tmp_path, yaml_text, overrides, hint):
    cfg_file = QUICKSTART
    if yaml_text:
        cfg_file = str(tmp_path / "typo.yaml")
        with open(cfg_file, "w") as f:
            f.write(yaml_text)
    status, _, err = _run_cli(capsys, "--mode", "info", "--cfg", cfg_file, *overrides)
    _assert_one_line(status, err, hint)


# Every kind of failure a command reports, and its status (the table in pycls/errors.py): the
# input's (2), the machine's (1), the loss's (3); (exception, status, words of the one line)
_FAILURES = {
    "a corrupt image": (
        lambda: CorruptImageError("cannot decode image /d/a.jpg: bad"),
        2,
        "error: cannot decode image /d/a.jpg: bad (DATA_LOADER.SKIP_CORRUPT True skips",
    ),
    "a corrupt data shard": (
        lambda: CorruptFileError("shard /d/shard_00001.bin is corrupt"),
        2,
        "error: shard /d/shard_00001.bin is corrupt",
    ),
    "an unsafe pickle": (
        lambda: UnsafePickleError("/d/data_batch_1 names os.system"),
        2,
        "error: /d/data_batch_1 names os.system",
    ),
    "other classes": (
        lambda: ClassMismatchError("test split lacks classes ['cat']"),
        2,
        "error: test split lacks classes ['cat']",
    ),
    "a held OUT_DIR": (lambda: RunLockedError("/o is used by pid 7"), 2, "error: /o is used"),
    "weights that do not fit": (
        lambda: WeightsError("TRAIN.WEIGHTS: /w.pth does not fit"),
        2,
        "error: TRAIN.WEIGHTS: /w.pth does not fit",
    ),
    "a full disk while checkpointing": (
        lambda: CheckpointWriteError("cannot write /o/c.pyth: No space left on device"),
        1,
        "error: cannot write /o/c.pyth: No space left on device",
    ),
    "a full disk while plotting": (
        lambda: OSError(errno.ENOSPC, "No space left on device", "/o/training_curves.png"),
        1,
        "error: /o/training_curves.png: No space left on device (free some space",
    ),
    "another failure of the machine": (
        lambda: EnvironmentFailure("cannot write /o/x: input/output error"),
        1,
        "error: cannot write /o/x: input/output error",
    ),
    "a zoo file offline": (
        lambda: PretrainedWeightsUnavailable("EfficientNet-B0: pretrained weights are not at /z"),
        2,
        "error: EfficientNet-B0: pretrained weights are not at /z",
    ),
    "a loader worker's corrupt image": (
        lambda: CorruptImageError(
            "Caught CorruptImageError in DataLoader worker process 0.\nOriginal Traceback (most "
            'recent call last):\n  File "x.py", line 1, in f\npycls.datasets.formats.imagefolder.'
            "CorruptImageError: cannot decode image /d/b.png: truncated"
        ),
        2,
        "error: cannot decode image /d/b.png: truncated (DATA_LOADER.SKIP_CORRUPT",
    ),
}


@pytest.mark.parametrize("failure", list(_FAILURES))
def test_every_failure_is_one_line_with_the_documented_exit_status(
    capsys, monkeypatch, tmp_path, failure
):
    make, status, words = _FAILURES[failure]

    def fail(fn, settings, mode, cfg):
        raise make()

    monkeypatch.setattr(launch, "launch", fail)
    got, _, err = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, "OUT_DIR", str(tmp_path))
    (line,) = err.strip().splitlines()
    assert got == status and line.startswith(words), (got, line)
    assert "Traceback" not in err


def _fail_in_spawned_process(mode, cfg):
    """Raises the failure OUT_DIR/failure names (spawned processes import this module anew)."""
    with open(os.path.join(cfg.OUT_DIR, "failure")) as f:
        raise _FAILURES[f.read()][0]()


@pytest.mark.slow  # two spawned processes per case
@pytest.mark.parametrize("failure", ["a full disk while plotting", "a corrupt image"])
def test_spawned_processes_report_a_failure_once_with_its_status(tmp_path, failure):
    (tmp_path / "failure").write_text(failure)
    cfg = tiny_quickstart(tmp_path, "NUM_PROCS", "2", "TRAIN.PARALLEL", "ddp", "DEVICE", "cpu")
    make, status, words = _FAILURES[failure]
    with pytest.raises((UserError, EnvironmentFailure)) as e:
        launch.launch(_fail_in_spawned_process, builders.launch_settings(cfg), "train", cfg)
    assert isinstance(e.value, UserError if status == 2 else EnvironmentFailure)
    assert e.value.one_line().startswith(words)


@pytest.mark.parametrize(
    "overrides, train, test",
    [
        (["TRAIN.IM_SIZE", "64"], 64, 64),  # not set: follows the training size
        (["TRAIN.IM_SIZE", "30", "VIT.PATCH_SIZE", "5"], 30, 30),  # 224 was refused: not /5
        (["TRAIN.IM_SIZE", "64", "TEST.IM_SIZE", "0"], 64, 64),
        (["TRAIN.IM_SIZE", "64", "TEST.IM_SIZE", "224"], 64, 224),  # set: kept
        ([], 224, 224),
    ],
)
def test_evaluation_size_follows_the_training_size_unless_set(overrides, train, test):
    """As upstream pycls and timm: a config that does not set TEST.IM_SIZE evaluates at
    TRAIN.IM_SIZE (it evaluated at 224 px after training at 64)."""
    cfg = config.load_cfg(None, overrides)
    assert (train, test) == (cfg.TRAIN.IM_SIZE, cfg.TEST.IM_SIZE)
    assert test == config.cfg_from_yaml_text(cfg.dump()).TEST.IM_SIZE  # recorded as such


@pytest.mark.parametrize(
    "warmup, epochs, warned",
    [
        ("2", "1", True),
        ("5", "5", True),
        ("0.5", "0.5", True),
        ("1", "2", False),
        ("0", "1", False),
    ],
)
def test_a_warmup_as_long_as_the_run_is_named_before_it_starts(
    capsys, monkeypatch, tmp_path, warmup, epochs, warned
):
    monkeypatch.setattr(launch, "launch", lambda fn, settings, mode, cfg: None)
    opts = ["OPTIM.WARMUP_EPOCHS", warmup, "OUT_DIR", str(tmp_path)]
    if "." not in epochs:
        opts += ["OPTIM.MAX_EPOCH", epochs]
    else:  # MAX_EPOCH is whole: a half-epoch warmup in a one-epoch run is fine
        opts += ["OPTIM.MAX_EPOCH", "1"]
        warned = False
    status, out, _ = _run_cli(capsys, "--mode", "train", "--cfg", QUICKSTART, *opts)
    lines = [ln for ln in out.splitlines() if ln.startswith("warning: OPTIM.WARMUP_EPOCHS")]
    assert status == 0 and len(lines) == int(warned), out
    if warned:
        assert "OPTIM.MAX_EPOCH" in lines[0] and "never reaches OPTIM.BASE_LR" in lines[0]


@pytest.mark.parametrize(
    "opts, key",
    [
        (["NUM_PROCS", "3"], "TRAIN.BATCH_SIZE"),
        (["NUM_PROCS", "2", "TEST.BATCH_SIZE", "33"], "TEST.BATCH_SIZE"),
        (
            ["NUM_PROCS", "2", "TRAIN.BATCH_SIZE", "12", "TRAIN.ACCUM_STEPS", "4"],
            "TRAIN.ACCUM_STEPS",
        ),
        (["NUM_GPUS", "3"], "TRAIN.BATCH_SIZE"),  # upstream's key, read as NUM_PROCS
    ],
)
def test_a_batch_the_processes_cannot_share_is_refused_before_any_starts(
    capsys, monkeypatch, tmp_path, opts, key
):
    """Found before any process starts (an upstream file's NUM_GPUS 8 started 8 processes that
    failed 51 s later on the batch size), naming the key and the process count."""

    def spawn(*args):
        raise AssertionError("no process may start")

    monkeypatch.setattr(launch, "_spawn", spawn)
    # The translation of NUM_GPUS is logged: not through the handlers an earlier in-process run
    # left on the root logger, whose streams pytest has closed since
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    args = ["--mode", "train", "--cfg", QUICKSTART, "TRAIN.BATCH_SIZE", "64", "TRAIN.PARALLEL"]
    args += ["ddp", *opts]  # processes that train together (none: refused before, for that)
    status, _, err = _run_cli(capsys, *args, "DEVICE", "cpu", "OUT_DIR", str(tmp_path / "o"))
    translated = "NUM_GPUS: upstream pycls's key (3) read as NUM_PROCS 3"  # the load's own note
    err = "".join(ln for ln in err.splitlines(True) if not ln.startswith(translated))
    _assert_one_line(status, err, f"config error: {key}: ", "processes")


@pytest.mark.slow  # a tiny two-epoch run, then four evaluations
def test_evaluation_is_labelled_with_the_checkpoints_own_epoch(capsys, tmp_path):
    out = tmp_path / "run"
    args = ["--cfg", QUICKSTART, *TINY, "OPTIM.MAX_EPOCH", "2", "TRAIN.EVAL_PERIOD", "1"]
    args += ["TRAIN.CHECKPOINT_PERIOD", "1"]
    assert cli.main(["--mode", "train", *args, "OUT_DIR", str(out)]) == 0
    best = checkpoint.load_file(str(out / "checkpoints" / "model_best.pyth"))["epoch"]
    files = {
        "model_epoch_0001.pyth": 1,
        "model_epoch_0002.pyth": 2,
        "model_best.pyth": best,
    }
    for name, epoch in [*files.items(), ("model_final.safetensors", 40)]:
        weights = out / ("checkpoints" if name.endswith(".pyth") else "") / name
        test_dir = tmp_path / f"test_{name}"
        test = ["--mode", "test", *args, "OPTIM.MAX_EPOCH", "40", "TEST.WEIGHTS", str(weights)]
        assert cli.main([*test, "OUT_DIR", str(test_dir)]) == 0
        (stats,) = json_stats_of(test_dir, "test_epoch")
        assert (stats["epoch"], stats["epoch_num"]) == (f"{epoch}/40", epoch), name
    capsys.readouterr()


@pytest.mark.parametrize(
    "command, words",
    [
        ("export", "--format {safetensors,timm,timm_folder,torchvision}"),
        ("consolidate", "folder"),
        ("prepare", "--dataset"),
        ("sweep-setup", "--sweep-cfg"),
        ("sweep-launch", "--dry-run"),
        ("sweep-collect", "--sweep-cfg"),
        ("sweep-analyze", "--sweep-cfg"),
    ],
)
def test_every_tool_is_a_command_of_pycls(capsys, monkeypatch, command, words):
    """An installed wheel has no tools/ folder: its ``pycls`` command runs each of them."""
    from pycls import __main__ as entry  # holds stop signals on import, as the command does

    monkeypatch.setattr(sys, "argv", ["pycls"])
    try:
        with pytest.raises(SystemExit) as e:
            entry.main([command, "--help"])
    finally:
        signals.release()
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: pycls {command} ") and words in out


def test_pycls_without_a_command_is_run_net(capsys, monkeypatch):
    from pycls import __main__ as entry

    try:
        with pytest.raises(SystemExit) as e:
            entry.main(["--mode", "info", "--cfg", QUICKSTART, "VIT.DEPTHH", "1"])
    finally:
        signals.release()
    assert e.value.code == 2
    assert "VIT.DEPTHH: unknown config key" in capsys.readouterr().err
