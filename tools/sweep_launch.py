#!/usr/bin/env python3
"""Train the unfinished runs of a set-up sweep with submitit (SLURM or local).

    python tools/sweep_launch.py --sweep-cfg configs/sweeps/quickstart_lr.yaml [--dry-run]

KEY VALUE pairs after the options override the sweep file (see pycls/sweep/sweep_file.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.sweep.submit import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
