"""shardlang: declarative sharding plans for PyTorch, compiled to parallelize_module / fully_shard calls.

import shardlang
plan = shardlang.load("plan.sl", params={"tp": 4})   # raises shardlang.PlanError(diagnostics)
plan.lint(model, world_size=8)                        # -> list[Diagnostic]
plan.apply(model)                                     # inside an initialised process group
report = shardlang.verify(plan, build_model, example_input)
print(plan.to_python())
shardlang.save_checkpoint(model, "ckpt", optimizer)    # DCP; loads under any plan and world size
shardlang.load_checkpoint(model, "ckpt", optimizer)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .frontend.diagnostics import CODES, Diagnostic, PlanError, Severity
from .frontend.ir import Plan
from .frontend.read import compile_file, compile_source
from .frontend.source import Source

__all__ = [
    "CODES",
    "Diagnostic",
    "Plan",
    "PlanError",
    "Severity",
    "load",
    "loads",
    "verify",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "convert_checkpoint",
]
__version__ = "0.1.0"

#: Names imported on first use: the checkpoint functions need torch.distributed.checkpoint, which
#: `shardlang lint` and the parser never do.
_LAZY = {
    "save_checkpoint": "checkpoints",
    "load_checkpoint": "checkpoints",
    "read_checkpoint": "checkpoints",
    "convert_checkpoint": "checkpoints",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'shardlang' has no attribute {name!r}")


def load(path: str | Path, params: Mapping[str, Any] | None = None, *, world_size: int | None = None) -> Plan:
    """Read, parse and check a plan file. `params` override its `param`s; `world_size` resolves `auto` dims."""
    plan, found, sources = compile_file(path, params, world_size)
    if plan is None:
        raise PlanError(found, sources)
    return plan


def loads(
    text: str, params: Mapping[str, Any] | None = None, *, name: str = "<string>", world_size: int | None = None
) -> Plan:
    """Parse and check plan text, as `load` does for a file."""
    source = Source(name, text)
    plan, found = compile_source(source, params, world_size)
    if plan is None:
        raise PlanError(found, {name: source})
    return plan


def verify(plan: Plan, build_model, example_input=None, loss=None, **options):
    """Apply `plan` to `build_model()` and run its checks; a Report (see shardlang.job.verify)."""
    from .launch.job import verify as run_verify

    return run_verify(plan, build_model, example_input, loss, **options)
