"""``python -m pycls`` and the ``pycls`` console command: what tools/run_net.py does.

pycls --mode train --cfg quickstart OUT_DIR /tmp/q
"""

import sys


def main():
    from pycls.core import early_signals

    early_signals.hold()  # before the slow imports: a stop signal now is recorded, not fatal
    from pycls.core.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
