"""``python -m pycls`` and the ``pycls`` console command: every command of pycls, as the tools/
scripts of a checkout run them.

    pycls --mode train --cfg quickstart OUT_DIR /tmp/q      train, test, time, ... (run_net.py)
    pycls export CHECKPOINT --format timm                   weights for elsewhere (export_weights)
    pycls consolidate OUT_DIR/checkpoints/model_epoch_0100  one file of a sharded checkpoint
    pycls prepare --dataset digits --out /tmp/shards        shards (prepare_dataset.py)
    pycls sweep-setup --sweep-cfg FILE                      and sweep-launch, sweep-collect,
                                                            sweep-analyze (sweep_*.py)

The console command calls this module's ``main``, imported after ``signals.hold()``; a command
other than training releases the held stop signals first (only training turns one into a
checkpoint).
"""

import os
import sys

from pycls import signals

signals.hold()  # before the slow imports: a stop signal now is recorded, not fatal

from pycls.core.cli import console_main  # noqa: E402
from pycls.core.weight_commands import consolidate_main, export_main  # noqa: E402
from pycls.datasets import prepare  # noqa: E402
from pycls.sweep import analyze, collect, setup, submit  # noqa: E402

# The commands besides training's (--mode ...): name -> (its main(argv, prog), what it does)
COMMANDS = {
    "export": (export_main, "a checkpoint's weights as safetensors, timm or torchvision"),
    "consolidate": (consolidate_main, "a sharded checkpoint folder as one file"),
    "prepare": (prepare.main, "a data set as memory-mapped shards (DATA_LOADER.BACKEND shards)"),
    "sweep-setup": (setup.main, "one config per point of a sweep file"),
    "sweep-launch": (submit.main, "train a sweep's unfinished runs (SLURM or local)"),
    "sweep-collect": (collect.main, "a sweep's results into sweep.json"),
    "sweep-analyze": (analyze.main, "a sweep's table and plots"),
}


def _prog():
    """How the user called us: "pycls", or "python -m pycls" (argv[0] is then this file)."""
    return "python -m pycls" if os.path.basename(sys.argv[0]) == "__main__.py" else "pycls"


def main(argv=None):
    """Runs ``pycls COMMAND ...`` or, without a command, ``pycls --mode MODE --cfg FILE ...``;
    exits with the command's status (pycls.errors)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        signals.release()
        command, _ = COMMANDS[argv[0]]
        sys.exit(command(argv[1:], prog=f"{_prog()} {argv[0]}"))
    console_main(argv)


if __name__ == "__main__":
    main()
