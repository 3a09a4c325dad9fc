"""The distribution version, in a leaf module (the package and the app both read it)."""

__version__ = "0.1.0"
