"""Program values (placements, dtypes, style constructors) as torch objects for apply and as Python source.

Both readings go through the same compiler.styles.Constructor, so the code `compile --emit python`
prints and the objects apply builds cannot disagree.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..compiler.styles import Constructor, Reference
from ..frontend import ir

# --- reading 1: objects ---------------------------------------------------------------------------


def import_path(path: str) -> Any:
    """`package.module.Name` or `package.module:Name` -> the object (ImportError/AttributeError if absent)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def to_torch(value: Any) -> Any:
    """ir layouts -> torch placements, dtypes -> torch dtypes, constructors -> objects; inside tuples and dicts too."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(value, Constructor):
        return build(value)
    if isinstance(value, Reference):
        return import_path(value.path)
    if isinstance(value, ir.DType):
        return getattr(torch, value.name)
    if isinstance(value, ir.Shard):
        return Shard(value.dim)
    if isinstance(value, ir.Replicate):
        return Replicate()
    if isinstance(value, ir.Partial):
        return Partial()
    if isinstance(value, tuple):
        return tuple(to_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: to_torch(v) for k, v in value.items()}
    return value


def build(ctor: Constructor, imported: dict[str, Any] | None = None) -> Any:
    """Call the constructor: the torch object apply hands to parallelize_module."""
    target = (imported or {}).get(ctor.path) or import_path(ctor.path)
    return target(**{k: to_torch(v) for k, v in ctor.kwargs})


# --- reading 2: source ----------------------------------------------------------------------------


def value_source(value: Any) -> str:
    """Python source for an argument value: placements as torch constructors."""
    if isinstance(value, Constructor):
        return source(value)
    if isinstance(value, Reference):
        return value.name
    if isinstance(value, ir.DType):
        return f"torch.{value.name}"
    if isinstance(value, ir.Shard):
        return f"Shard({value.dim})"
    if isinstance(value, ir.Replicate):
        return "Replicate()"
    if isinstance(value, ir.Partial):
        return "Partial()"
    if isinstance(value, tuple):
        inner = ", ".join(value_source(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {value_source(v)}" for k, v in value.items()) + "}"
    return repr(value)


def source(ctor: Constructor) -> str:
    args = ", ".join(f"{k}={value_source(v)}" for k, v in ctor.kwargs)
    return f"{ctor.name}({args})"


def names_used(value: Any) -> set[str]:
    """The import paths a value's source needs (placement classes, constructors)."""
    if isinstance(value, (ir.Shard, ir.Replicate, ir.Partial)):
        return {f"torch.distributed.tensor.{type(value).__name__}"}
    if isinstance(value, Constructor):
        return {value.path}.union(*(names_used(v) for _, v in value.kwargs))
    if isinstance(value, Reference):
        return {value.path}
    if isinstance(value, tuple):
        return set().union(*(names_used(v) for v in value))
    if isinstance(value, dict):
        return set().union(*(names_used(v) for v in value.values()))
    return set()
