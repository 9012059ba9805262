"""DSL styles -> torch ParallelStyle constructors, as one table read two ways: `build` makes the objects
that apply runs, `source` writes the Python that `compile --emit python` prints.

A style lowers to a `Constructor`: a torch callable by import path and its keyword arguments (plain
values, placements as `ir` layouts). Both readings go through it, so they cannot disagree.
"""

from __future__ import annotations

import importlib
from typing import Any

from attrs import frozen

from ..frontend import ir

TP = "torch.distributed.tensor.parallel"


@frozen
class Constructor:
    """`path(**kwargs)`: a torch (or user) callable by import path, and its keyword arguments."""

    path: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.path.replace(":", ".").rsplit(".", 1)[-1]


def _placement(layout: Any) -> Any:
    """`_` (a non-tensor input) is None in torch's input layouts."""
    return None if isinstance(layout, ir.NonTensor) else layout


def _layouts(value: tuple) -> Any:
    """One layout stays a single placement; several become a tuple, as PrepareModuleInput takes them."""
    items = tuple(_placement(v) for v in value)
    return items[0] if len(items) == 1 else items


def constructor(style: ir.Style) -> Constructor:
    """The torch constructor for a built-in style, or the user's for a `use` style (ParallelStyle subclass)."""
    get = style.get
    if style.use is not None:
        return Constructor(style.use.path, tuple((k, _passthrough(v)) for k, v in style.kwargs))
    if style.name in ("colwise", "rowwise"):
        cls = "ColwiseParallel" if style.name == "colwise" else "RowwiseParallel"
        kwargs = {
            "input_layouts": get("input"),
            "output_layouts": get("output"),
            "use_local_output": get("local_output"),
        }
        return Constructor(f"{TP}.{cls}", _given(kwargs))
    if style.name == "sequence_parallel":
        return Constructor(
            f"{TP}.SequenceParallel", _given({"sequence_dim": get("dim"), "use_local_output": get("local_output")})
        )
    if style.name == "prepare_input":
        kwargs = {
            "input_layouts": _layouts(get("input")) if get("input") is not None else None,
            "desired_input_layouts": _layouts(get("desired")) if get("desired") is not None else None,
            "input_kwarg_layouts": dict(get("input_kwargs")) if get("input_kwargs") is not None else None,
            "desired_input_kwarg_layouts": dict(get("desired_kwargs")) if get("desired_kwargs") is not None else None,
            "use_local_output": get("local_output"),
        }
        return Constructor(f"{TP}.PrepareModuleInput", _given(kwargs))
    if style.name == "prepare_output":
        kwargs = {
            "output_layouts": _layouts(get("output")) if get("output") is not None else None,
            "desired_output_layouts": _layouts(get("desired")) if get("desired") is not None else None,
            "use_local_output": get("local_output"),
        }
        return Constructor(f"{TP}.PrepareModuleOutput", _given(kwargs))
    raise ValueError(f"style {style.name} is not a ParallelStyle")  # distribute lowers to distribute_module


def _given(kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in kwargs.items() if v is not None)


def _passthrough(value: Any) -> Any:
    """User style arguments: `(a, b)` stays a tuple, `(x=shard(0))` becomes a dict, `_` becomes None."""
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value)
    ):
        return {k: _passthrough(v) for k, v in value}
    if isinstance(value, tuple):
        return tuple(_passthrough(v) for v in value)
    return _placement(value)


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
    if isinstance(value, tuple):
        return set().union(*(names_used(v) for v in value))
    if isinstance(value, dict):
        return set().union(*(names_used(v) for v in value.values()))
    return set()
