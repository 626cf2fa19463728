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

from pycls.core.command_line import read_request_or_exit  # noqa: E402


# Each command loads its own module when it runs (torch with most of them): ``pycls --mode ...``
# checks its config, and ``pycls COMMAND --help`` answers, before any of them loads.
def _export(argv, prog):
    from pycls.core.weight_commands import export_main  # the command that runs, when it runs

    return export_main(argv, prog=prog)


def _consolidate(argv, prog):
    from pycls.core.weight_commands import consolidate_main  # the command that runs

    return consolidate_main(argv, prog=prog)


def _prepare(argv, prog):
    from pycls.datasets.formats import prepare  # the command that runs, when it runs

    return prepare.main(argv, prog=prog)


def _sweep(step):
    def run(argv, prog):
        from pycls.sweep import analyze, collect, setup, submit  # the command that runs

        module = {"setup": setup, "launch": submit, "collect": collect, "analyze": analyze}[step]
        return module.main(argv, prog=prog)

    return run


# The commands besides training's (--mode ...): name -> (its main(argv, prog), what it does)
COMMANDS = {
    "export": (_export, "a checkpoint's weights as safetensors, timm or torchvision"),
    "consolidate": (_consolidate, "a sharded checkpoint folder as one file"),
    "prepare": (_prepare, "a data set as memory-mapped shards (DATA_LOADER.BACKEND shards)"),
    "sweep-setup": (_sweep("setup"), "one config per point of a sweep file"),
    "sweep-launch": (_sweep("launch"), "train a sweep's unfinished runs (SLURM or local)"),
    "sweep-collect": (_sweep("collect"), "a sweep's results into sweep.json"),
    "sweep-analyze": (_sweep("analyze"), "a sweep's table and plots"),
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
    request = read_request_or_exit(argv)  # a mistake: one line and its exit status, no torch
    # The run (torch, the engines), imported once the command line and the config are right
    from pycls.core.cli import console_main

    console_main(argv, request)


if __name__ == "__main__":
    main()
