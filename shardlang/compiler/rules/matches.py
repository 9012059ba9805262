"""Overlaps (SL201, SL205): a module matched by two rules, or made a unit twice or of both kinds."""

from __future__ import annotations

from collections import defaultdict

from ...frontend import ir
from ...frontend.diagnostics import SL201, SL205, Diagnostic
from ..predict import INPUT_OUTPUT_STYLES, style_kind
from ..resolve import Resolution, RuleMatch, UnitMatch
from .common import Predictions, Shapes, unit_span


def duplicate_matches(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL201: a module matched by two rules of one parallelize block, by two rules of different blocks
    that both distribute its parameters, or wrapped by two units of the same kind. (prepare_input in one
    block and prepare_output in another may share a module.) One diagnostic per pair of rules."""
    pairs: dict[tuple, list[str]] = defaultdict(list)
    first: dict[tuple, RuleMatch] = {}
    for match in resolution.rules:
        moves_params = style_kind(match.rule.style) not in INPUT_OUTPUT_STYLES
        for key in ((match.block, match.fqn), ("params", match.fqn) if moves_params else None):
            if key is None:
                continue
            earlier = first.setdefault(key, match)
            if earlier is not match and earlier.rule is not match.rule:
                pairs[(earlier.rule, match.rule)].append(match.fqn or "root")
                break
    found = [
        Diagnostic(
            SL201,
            f"{_modules(fqns)} matched by two rules",
            second.target.span,
            (f"the first rule is at line {rule.span.line}: {rule.target} : {rule.style.name}",),
            label="second match",
        )
        for (rule, second), fqns in pairs.items()
    ]
    units: dict[tuple[str, str], UnitMatch] = {}
    for unit in resolution.units:
        kind = unit.kind(plan.units[unit.block])
        for fqn in unit.fqns:
            earlier = units.get((kind, fqn))
            if earlier is not None:
                where = (
                    f"`{earlier.unit}` at line {earlier.unit.span.line}"
                    if earlier.unit
                    else f"the root unit at line {unit_span(plan, earlier).line}"
                )
                found.append(
                    Diagnostic(
                        SL201,
                        f"module '{fqn or 'root'}' is made a {kind} unit twice",
                        unit_span(plan, unit),
                        (f"the first is {where}",),
                        label="second match",
                    )
                )
            units[(kind, fqn)] = unit
    return found


def _modules(fqns: list[str]) -> str:
    """`'a' is` or `'a' (and 3 more) are`: the modules a diagnostic is about."""
    if len(fqns) == 1:
        return f"module '{fqns[0]}' is"
    return f"modules '{fqns[0]}' and {len(fqns) - 1} more are"


def unit_conflicts(plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes) -> list[Diagnostic]:
    """SL205: one module both a fully_shard unit and a replicate unit."""
    by_kind = defaultdict(dict)
    for unit in resolution.units:
        for fqn in unit.fqns:
            by_kind[unit.kind(plan.units[unit.block])].setdefault(fqn, unit)
    found = []
    for fqn, rep in by_kind["replicate"].items():
        fs = by_kind["fully_shard"].get(fqn)
        if fs is not None:
            found.append(
                Diagnostic(
                    SL205,
                    f"module '{fqn or 'root'}' is both a fully_shard unit and a replicate unit",
                    unit_span(plan, rep),
                    (f"the fully_shard unit is at line {unit_span(plan, fs).line}",),
                )
            )
    return found
