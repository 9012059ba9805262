"""The `shardlang` command: argument parsing and rendering only; the stages do the work."""

from .main import command, main

__all__ = ["command", "main"]
