"""Command line shared by tools/sweep_{setup,launch,collect,analyze}.py.

    python tools/sweep_STEP.py --sweep-cfg FILE [options] [KEY VALUE ...]

KEY VALUE pairs override the sweep file (``ROOT_DIR /tmp/sweeps``); ``SETUP.OVERRIDES.<pycls key>
VALUE`` adds a fixed override of the runs (``SETUP.OVERRIDES.OPTIM.MAX_EPOCH 1``). Give every step
the same file and overrides.
"""

import argparse
import sys

from pycls.config import ConfigError
from pycls.errors import EXIT_USER_ERROR, REPORTED, reported
from pycls.sweep import commands
from pycls.sweep.sweep_file import load_sweep_cfg


def parse_args(description, argv=None, add_args=None, prog=None):
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="KEY VALUE pairs after the options override the sweep file, e.g. ROOT_DIR "
        "/tmp/sweeps SETUP.OVERRIDES.OPTIM.MAX_EPOCH 1 (give every step the same ones)",
    )
    parser.add_argument("--sweep-cfg", dest="sweep_cfg", required=True, help="sweep file (YAML)")
    if add_args is not None:
        add_args(parser)
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides")
    return parser.parse_args(argv)


def run_tool(description, fn, argv=None, add_args=None, prog=None):
    """Parses the command line, loads the sweep file and returns fn(sweep_cfg, args)'s exit code;
    mistakes in the sweep file or the sweep's state (exit 2) and failures of the machine (exit 1)
    become one line on stderr (pycls.errors: exit statuses)."""
    args = parse_args(description, argv, add_args, prog)
    commands.invoked_as(prog)  # the messages name the next step as the user runs the steps
    misplaced = [o for o in args.opts if str(o).startswith("--")]
    if misplaced:
        print(f"sweep: put options {misplaced} before the KEY VALUE overrides", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        sc = load_sweep_cfg(args.sweep_cfg, args.opts)
        return fn(sc, args)
    except ConfigError as e:
        print(f"sweep config error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except REPORTED as e:  # SweepError (the sweep's folder or a file of it), a full disk
        status, line = reported(e)
        print(line, file=sys.stderr)
        return status
