"""Compiled modules (SL301): what the installed torch cannot compile."""

from __future__ import annotations

from ...frontend import ir, patterns
from ...frontend.diagnostics import SL301, Diagnostic, few
from ..resolve import Resolution
from ..torchlimits import COMPILE_FULLGRAPH_CHECKPOINT, cannot
from .common import Predictions, Shapes


def fullgraph_over_checkpoint(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL301: `compile (fullgraph=true)` of a module that activation checkpointing covers, where the
    installed torch cannot trace the checkpoint's hooks."""
    if not cannot(COMPILE_FULLGRAPH_CHECKPOINT):
        return []
    found = []
    for fqn, statement in resolution.compiled:
        if not dict(statement.options).get("fullgraph", False):
            continue
        covered = [c for c in resolution.checkpoint if patterns.within(c, fqn)]
        if covered:
            found.append(
                Diagnostic(
                    SL301,
                    f"compile (fullgraph=true) of '{fqn or 'root'}', which activation checkpointing covers "
                    f"({few(covered)}): this torch cannot trace the checkpoint's hooks in one graph",
                    statement.span,
                    help=("drop fullgraph=true (the hooks then break the graph and the step runs)",),
                )
            )
    return found
