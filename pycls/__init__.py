"""pycls: fast Vision Transformer training from one config file."""

__version__ = "0.1.0"
