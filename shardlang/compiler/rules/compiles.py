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


def fullgraph_over_context_parallel(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL301: `compile (fullgraph=true)` of a module inside which context parallelism runs its attention:
    dynamo cannot trace its attention (a TorchFunctionMode around the module's forward, and collectives)
    in one graph (torch 2.11 and 2.13)."""
    found = []
    for fqn, statement in resolution.compiled:
        inside = [a for a in resolution.context if patterns.within(a, fqn)]
        if dict(statement.options).get("fullgraph", False) and inside:
            found.append(
                Diagnostic(
                    SL301,
                    f"compile (fullgraph=true) of '{fqn or 'root'}', inside which context_parallel runs attention "
                    f"({few(inside)}): dynamo cannot trace that in one graph",
                    statement.span,
                    help=("drop fullgraph=true: the attention then breaks the graph and the step runs",),
                )
            )
    return found
