#!/usr/bin/env python3
"""Write a markdown table and PNG plots of a collected sweep into ROOT_DIR/NAME/analysis/.

    python tools/sweep_analyze.py --sweep-cfg configs/sweeps/quickstart_lr.yaml

KEY VALUE pairs after the options override the sweep file (see pycls/sweep/sweep_file.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.sweep.analyze import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
