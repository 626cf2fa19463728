#!/usr/bin/env python3
"""The single entry point: train, test, time or inspect a model from a YAML config.

python tools/run_net.py --mode train --cfg configs/quickstart.yaml OUT_DIR /tmp/q
python tools/run_net.py --mode info --cfg configs/vit_h16.yaml

The command line and the config are read and checked first, without torch: a mistyped key is
answered at once; the run itself (pycls.core.cli) loads after.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls import signals  # noqa: E402

signals.hold()  # before the slow imports: a stop signal now is recorded, not fatal

from pycls.core.command_line import read_request_or_exit  # noqa: E402


def main():
    request = read_request_or_exit()  # a mistake: one line and its exit status, no torch loaded
    # The run (torch, the engines), imported once the command line and the config are right
    from pycls.core.cli import console_main

    console_main(request=request)


if __name__ == "__main__":
    main()
