"""``python -m pycls`` and the ``pycls`` console command: what tools/run_net.py does.

pycls --mode train --cfg quickstart OUT_DIR /tmp/q

The console command calls this module's ``main`` (the command line's, which also ends the
process: ``pycls.core.cli.console_main``), imported after ``signals.hold()``.
"""

from pycls import signals

signals.hold()  # before the slow imports: a stop signal now is recorded, not fatal

from pycls.core.cli import console_main as main  # noqa: E402

if __name__ == "__main__":
    main()
