"""`python -m shardlang`: the same as the `shardlang` command (and how torchrun starts it)."""

import sys

from .cli import main

sys.exit(main())
