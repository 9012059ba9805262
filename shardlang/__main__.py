"""`python -m shardlang`: the same as the `shardlang` command (and how torchrun starts it)."""

from .cli import command

command()
