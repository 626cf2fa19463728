"""Re-export shim: ``pycls.core.config`` is where upstream pycls and earlier pycls releases kept
the config; it now lives in the package ``pycls.config`` (defaults, checks, loading), and this
module re-exports its public names so that ``from pycls.core.config import load_cfg`` keeps
working."""

from pycls.config import *  # noqa: F401,F403  (re-exported)
from pycls.config import __all__  # noqa: F401
