"""The library version (as in pyproject.toml)."""

__version__ = "0.1.0"
