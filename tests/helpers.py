"""What several test files share: the repository's paths and a tiny, fast quickstart."""

import os
import shutil

from pycls.core import checkpoint, config
from pycls.core.logging import load_json_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
RUN_NET = os.path.join(ROOT, "tools", "run_net.py")

# The quickstart shrunk to one narrow block, so each epoch takes about a second
TINY = [
    "VIT.DEPTH",
    "1",
    "VIT.WIDTH",
    "32",
    "VIT.NUM_HEADS",
    "2",
    "VIT.MLP_DIM",
    "64",
    "TRAIN.BATCH_SIZE",
    "64",
    "LOG_PERIOD",
    "5",
]


def tiny_quickstart(out_dir, *overrides):
    """The tiny quickstart config writing to ``out_dir``, with KEY VALUE overrides."""
    return config.load_cfg(QUICKSTART, [*TINY, "OUT_DIR", str(out_dir), *overrides])


def json_stats_of(out_dir, kind):
    """The json_stats lines of ``_type`` kind in OUT_DIR/stdout.log, in order."""
    stats = load_json_stats(os.path.join(str(out_dir), "stdout.log"))
    return [s for s in stats if s["_type"] == kind]


def resume_from(full_dir, resumed_dir, epoch):
    """A fresh OUT_DIR holding only the checkpoint ``full_dir`` wrote after ``epoch``: training
    there resumes as if the first run had been stopped at that point."""
    os.makedirs(checkpoint.get_checkpoint_dir(str(resumed_dir)))
    shutil.copy(
        checkpoint.get_checkpoint_path(str(full_dir), epoch),
        checkpoint.get_checkpoint_path(str(resumed_dir), epoch),
    )
