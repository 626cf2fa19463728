#!/usr/bin/env python3
"""The single entry point: train, test, time or inspect a model from a YAML config.

python tools/run_net.py --mode train --cfg configs/quickstart.yaml OUT_DIR /tmp/q
python tools/run_net.py --mode info --cfg configs/vit_h16.yaml
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls import signals  # noqa: E402

signals.hold()  # before the slow imports: a stop signal now is recorded, not fatal

from pycls.core.cli import console_main  # noqa: E402

if __name__ == "__main__":
    console_main()
