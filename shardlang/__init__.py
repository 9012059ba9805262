"""shardlang: declarative sharding plans for PyTorch, compiled to parallelize_module / fully_shard calls.

import shardlang
plan = shardlang.load("plan.sl", params={"tp": 4})   # raises shardlang.PlanError(diagnostics)
plan.lint(model, world_size=8)                        # -> list[Diagnostic]
plan.apply(model)                                     # inside an initialised process group
report = shardlang.verify(plan, build_model, example_input)
print(plan.to_python())
shardlang.save_checkpoint(model, "ckpt", optimizer)    # DCP; loads under any plan and world size
shardlang.load_checkpoint(model, "ckpt", optimizer)
shardlang.load_hf_weights(model, "hf_dir")             # safetensors; each rank reads only its shards
shardlang.save_hf_weights(model, "hf_out")             # what from_pretrained reads
print(shardlang.init_plan(model, tp=2))               # a starter plan for a model (built on meta is enough)
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .api import Plan, load, loads, verify
from .frontend.diagnostics import CODES, Diagnostic, PlanError, Severity

__all__ = [
    "CODES",
    "Diagnostic",
    "Plan",
    "PlanError",
    "Severity",
    "__version__",
    "load",
    "loads",
    "verify",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "convert_checkpoint",
    "load_hf_weights",
    "save_hf_weights",
    "init_plan",
]

#: Names imported on first use: the checkpoint functions need torch.distributed.checkpoint, which
#: `shardlang lint` and the parser never do.
_LAZY = {
    "save_checkpoint": "checkpoints.saving",
    "load_checkpoint": "checkpoints.loading",
    "read_checkpoint": "checkpoints.reading",
    "convert_checkpoint": "checkpoints.converting",
    "load_hf_weights": "checkpoints.hf",
    "save_hf_weights": "checkpoints.hf",
    "init_plan": "compiler.starter",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'shardlang' has no attribute {name!r}")
