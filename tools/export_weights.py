#!/usr/bin/env python3
"""Convert a pycls checkpoint's weights for use elsewhere: safetensors, timm or torchvision.

    python tools/export_weights.py CHECKPOINT --format safetensors|timm|torchvision [--out FILE]

The same command as ``pycls export`` (pycls/core/weight_commands.py, which documents it).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.core.weight_commands import export_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
