"""The `shardlang` command: argument parsing and rendering only; the stages do the work."""

from .main import main

__all__ = ["main"]
