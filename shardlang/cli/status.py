"""Exit statuses, and the usage error any command may raise (exit status 2)."""

from __future__ import annotations

#: Exit statuses (docs/diagnostics.md).
OK, FOUND, UNUSABLE = 0, 1, 2


class UsageError(Exception):
    """A command line that cannot be carried out (missing file, bad -D); exit status 2."""
