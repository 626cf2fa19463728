#!/usr/bin/env python3
"""Turn a sharded (torch.distributed.checkpoint) checkpoint folder into one pycls file.

    python tools/consolidate_checkpoint.py OUT_DIR/checkpoints/model_epoch_0100 [--out FILE]

The same command as ``pycls consolidate`` (pycls/core/weight_commands.py, which documents it).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.core.weight_commands import consolidate_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
