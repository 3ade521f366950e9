"""lumend: the per-node LUMEN daemon."""

__version__ = "0.1.0"
