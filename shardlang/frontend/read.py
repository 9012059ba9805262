"""The front end in one call: plan bytes -> Source -> syntax tree -> checked plan IR, with every diagnostic."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .diagnostics import Diagnostic, sort_key
from .ir import Plan
from .parse import decode, parse
from .source import MAX_PLAN_BYTES, Source
from .static_checks import check


def read_source(
    source: Source, params: Mapping[str, Any] | None = None, world_size: int | None = None
) -> tuple[Plan | None, list[Diagnostic]]:
    """Parse and check; the plan is None when any error was found."""
    module, found = parse(source)
    plan = None
    if module is not None:
        plan, found = check(module, source, params, world_size)
    return plan, sorted(found, key=sort_key)


def _read_at_most(path: Path, limit: int) -> bytes:
    """At most `limit` bytes: `/dev/zero` or a huge file is refused (SL102) without reading it all."""
    with path.open("rb") as f:
        chunks, left = [], limit
        while left > 0:
            chunk = f.read(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)


def read_file(
    path: str | Path, params: Mapping[str, Any] | None = None, world_size: int | None = None
) -> tuple[Plan | None, list[Diagnostic], dict[str, Source]]:
    """Read a plan file (OSError if it cannot be read) and check it; also returns the sources for rendering."""
    source, found = decode(str(path), _read_at_most(Path(path), MAX_PLAN_BYTES + 1))
    if source is None:
        return None, found, {}
    plan, found = read_source(source, params, world_size)
    return plan, found, {source.name: source}
