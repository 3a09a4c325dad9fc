"""The wire version every message carries (``"version": WIRE_VERSION``)."""

WIRE_VERSION = 1

__all__ = ["WIRE_VERSION"]
