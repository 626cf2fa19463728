#!/usr/bin/env python3
"""Write one full pycls config per point of a sweep into ROOT_DIR/NAME/cfgs/.

    python tools/sweep_setup.py --sweep-cfg configs/sweeps/quickstart_lr.yaml

KEY VALUE pairs after the options override the sweep file (see pycls/sweep/sweep_file.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.sweep.setup import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
