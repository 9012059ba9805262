"""Traceback frames: which are the user's own (their model file, their styles) and which a library's, and
where each is, for a failure's report."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import traceback
from pathlib import Path


#: Where code that is not the user's lives: shardlang, torch, the standard library, installed packages.
@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = {str(Path(__file__).resolve().parents[1])}
    try:
        import torch

        dirs.add(str(Path(torch.__file__).resolve().parent))
    except ImportError:
        pass
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(str(Path(path).resolve()))
    return tuple(sorted(dirs))


def chain(error: BaseException) -> list[BaseException]:
    """`error` and what caused it, the first cause first (whose traceback reaches deepest)."""
    found, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return found[::-1]


def user_stack(error: BaseException, limit: int = 6) -> list[traceback.FrameSummary]:
    """The frames of `error`'s traceback (and of what caused it) that are in the user's own files, innermost
    last: what to show instead of shardlang's and torch's internals."""
    frames = []
    for e in chain(error):
        for frame in traceback.extract_tb(e.__traceback__):
            if package_of(frame.filename) is None:
                frames.append(frame)
    return frames[-limit:]


def package_of(filename: str) -> tuple[str, str] | None:
    """For a file that is not the user's: the package it belongs to, with its version where installed
    (`transformers 5.24.0`, `torch 2.13.0`, `shardlang 0.4`, `python 3.11`), and its path inside the
    directory it was installed in (`transformers/models/llama/modeling_llama.py`). None for the user's
    own files (a model file, their styles, a package of theirs outside site-packages)."""
    if filename.startswith("<"):
        return "python", filename
    path = str(Path(filename).resolve())
    for root in sorted(_library_dirs(), key=len, reverse=True):  # site-packages before the stdlib holding it
        if path.startswith(root + os.sep):
            inside = Path(path).relative_to(root)
            if root.endswith(("shardlang", "torch")):  # the package directory itself, not its parent
                inside = Path(Path(root).name) / inside
            return _versioned(inside.parts[0], root), str(inside)
    return None


@functools.cache
def _versioned(top: str, root: str) -> str:
    from importlib import metadata

    if top.endswith(".py") or root in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")):
        return f"python {sys.version_info[0]}.{sys.version_info[1]}"
    # Most packages are installed under their own name; the map of every installed distribution's top-level
    # names reads all their metadata (0.3 s of a core each time, 13 s for a traceback of 45 frames).
    for name in (top, *_distributions().get(top, [])):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{top} {metadata.version(name)}"
    return top


@functools.cache
def _distributions() -> dict[str, list[str]]:
    from importlib import metadata

    return dict(metadata.packages_distributions())


def where(frame: traceback.FrameSummary) -> str:
    """`examples/model.py:12 in forward: raise ValueError(...)`, the path relative to here where it can be."""
    path = Path(frame.filename)
    with contextlib.suppress(ValueError):
        path = path.resolve().relative_to(Path.cwd())
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{path}:{frame.lineno} in {frame.name}{code}"
