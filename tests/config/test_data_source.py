"""What DATA.PATH holds, found once without torch (pycls/config/data_source.py), and the two
mistakes a machine answers in a second: a data path that is not there and an OUT_DIR a live run
holds, answered by tools/run_net.py before torch loads, in one line, exit status 2."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from pycls import config
from pycls.checkpoint import run_lock
from pycls.config import data_source
from pycls.datasets.formats import data_sources
from pycls.datasets.formats.tar_writer import write_webdataset
from tests.helpers import QUICKSTART, ROOT, RUN_NET

VIT_TI = os.path.join(ROOT, "configs", "vit_ti16.yaml")  # an ImageNet config: it reads DATA.PATH


def _run_net(*args):
    """tools/run_net.py with ``args``, its imports listed (-X importtime): (status, the last line
    of stderr, the modules it imported)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-X", "importtime", RUN_NET, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    lines = p.stderr.splitlines()
    imported = [line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import ")]
    said = [line for line in lines if not line.startswith("import ")]
    return p.returncode, said, imported


def _torch_in(imported):
    return sorted(m for m in imported if m.split(".")[0] in ("torch", "torchvision"))


@pytest.mark.parametrize(
    "cfg, path",
    [(VIT_TI, "imagenet"), (QUICKSTART, "shards-{000000..000003}.tar")],
    ids=["image folder", "tar pattern"],
)
def test_a_data_path_that_is_not_there_is_answered_before_torch_loads(tmp_path, cfg, path):
    """Broke when a DATA.PATH that does not exist was found only by the data builder, after
    torch, the engines and the trainer had loaded (19-53 s on a busy machine): one line naming
    the key, exit 2, and no torch module imported."""
    missing = str(tmp_path / "gone" / path)
    status, said, imported = _run_net("--mode", "train", "--cfg", cfg, "DATA.PATH", missing,
                                      "OUT_DIR", str(tmp_path / "run"))  # fmt: skip
    assert status == 2 and _torch_in(imported) == [], said
    assert said == [f"config error: DATA.PATH: {missing} does not exist" + (
        f" (no folder {tmp_path / 'gone'})" if "{" in path else "")], said  # fmt: skip
    assert not (tmp_path / "run").exists()  # nothing written


def test_an_out_dir_a_live_run_holds_is_answered_before_torch_loads(tmp_path):
    """Broke when the lock of a running run was found only once the trainer had loaded: the
    holder (this test's process, alive) is named in one line, exit 2, without torch."""
    out = tmp_path / "run"
    out.mkdir()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": time.time()}
    (out / "run.lock").write_text(json.dumps(holder))
    status, said, imported = _run_net("--mode", "train", "--cfg", QUICKSTART, "OUT_DIR", str(out))
    assert status == 2 and _torch_in(imported) == [], said
    assert len(said) == 1 and f"OUT_DIR {out} is in use by another run" in said[0], said
    assert f"pid {os.getpid()}" in said[0]
    # a lock whose process is gone is no answer: the run goes on (and takes it over)
    (out / "run.lock").write_text(json.dumps({**holder, "pid": 2**22 + 12345}))
    run_lock.refuse_if_held(str(out))


def test_the_data_source_is_found_once_and_handed_to_the_machine_step(tmp_path, monkeypatch):
    """What DATA.PATH holds and how it is reached, as the command line finds it, is what the
    machine step resolves with: given it, the step lists nothing again (broke if it did)."""
    folder = tmp_path / "wds"
    write_webdataset(_Two(), folder, split="train", shard_size=2, encoding="png")
    cfg = config.read_cfg(QUICKSTART, ["DATA.PATH", str(folder)])
    source = data_source.find_data_source(cfg)
    assert (source.holds, source.reached) == ("wds", "local")
    assert source.describe() == f"{folder}: wds"
    url = config.read_cfg(QUICKSTART, ["DATA.PATH", "s3://bucket/x-{0..3}.tar"])
    found = data_source.find_data_source(url)
    assert (found.path, found.holds, found.reached) == ("s3://bucket/x-{0..3}.tar", "wds", "s3")
    assert found.split_files("train")[0] == [f"s3://bucket/x-{k}.tar" for k in range(4)]

    def listed_again(*args, **kwargs):
        raise AssertionError("DATA.PATH listed a second time")

    monkeypatch.setattr(data_sources, "detect_format", listed_again)
    resolved = config.resolve_for_machine(cfg, [], source)
    assert resolved.DATA_LOADER.BACKEND == "wds" and resolved.TRAIN.DATASET == "imagefolder"


def test_synthetic_data_reads_no_path_and_a_digits_config_refuses_one_it_would_ignore(tmp_path):
    """Synthetic data (for timing) reads no folder, so a DATA.PATH that is not there is no
    mistake; the bundled digits would ignore one: refused, saying so. A shard folder that is
    not there is refused by the modes that read data only."""
    gone = str(tmp_path / "gone")
    opts = ["TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic", "DATA.PATH", gone]
    assert data_source.find_data_source(config.read_cfg(QUICKSTART, opts)).holds == "missing"
    with pytest.raises(config.ConfigError, match="does not exist .* digits reads no folder"):
        data_source.find_data_source(config.read_cfg(QUICKSTART, ["DATA.PATH", gone]))
    shards = config.read_cfg(
        QUICKSTART, ["DATA_LOADER.BACKEND", "shards", "DATA_LOADER.SHARD_PATH", gone]
    )
    source = data_source.find_data_source(shards)  # --mode info or time ask no more
    with pytest.raises(config.ConfigError, match="^DATA_LOADER.SHARD_PATH: .* does not exist"):
        data_source.require_readable(shards, source)  # the modes that read data refuse it


class _Two:
    """Two 4 px images of two classes (a source for the tar writer)."""

    classes, num_classes, labels = ["a", "b"], 2, [0, 1]

    def __len__(self):
        return 2

    def __getitem__(self, k):
        return torch.full((3, 4, 4), 40 * k, dtype=torch.uint8), k
