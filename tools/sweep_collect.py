#!/usr/bin/env python3
"""Gather every run's json_stats, config and complexity into ROOT_DIR/NAME/sweep.json.

    python tools/sweep_collect.py --sweep-cfg configs/sweeps/quickstart_lr.yaml

KEY VALUE pairs after the options override the sweep file (see pycls/sweep/sweep_file.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.sweep.collect import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
