"""What the lint rules share: the `Rule` protocol every rule keeps, mesh dim sizes and where a unit is written."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol, TypeAlias

from ...frontend import ir
from ...frontend.diagnostics import Diagnostic
from ...frontend.source import Span
from ..predict import Placed
from ..resolve import Resolution, UnitMatch

#: What `predict` says each parameter gets, by its fully qualified name.
Predictions: TypeAlias = Mapping[str, Placed]
#: Each mesh's shape at the world size being linted, by mesh name.
Shapes: TypeAlias = Mapping[str, tuple[int, ...]]


class Rule(Protocol):
    """A lint rule, as sqlglot's optimizer rules are: a plain function that reads what lint knows of the
    plan at one world size and returns the diagnostics it finds. It changes nothing, so no rule depends on
    another having run, and a caller may run a subset or add its own: `lint(plan, model, world,
    rules=(*RULES, mine))`.

    `plan`: the checked IR; `resolution`: which modules each rule and unit matched (compiler.resolve);
    `predictions`: each parameter's predicted placements; `shapes`: each mesh's shape at this world size."""

    def __call__(
        self, plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
    ) -> list[Diagnostic]: ...


def dim_sizes(plan: ir.Plan, shapes: Shapes) -> dict[tuple[str, str], int]:
    """(mesh, dim) -> size at this world size; a flattened dim (`world[dp*ep]`) by its name (`dp_ep`)."""
    sizes = {(m.name, d): n for m in plan.meshes for d, n in zip(m.dim_names, shapes[m.name])}
    for ref in (block.mesh for block in plan.units):
        if ref.flat:
            sizes[(ref.mesh, ref.flat_name)] = math.prod(sizes[(ref.mesh, d)] for d in ref.dims)
    return sizes


def unit_span(plan: ir.Plan, unit: UnitMatch) -> Span:
    """Where a unit is written: its `each`, or its block for the implicit root unit."""
    return unit.unit.span if unit.unit is not None else plan.units[unit.block].span


def pipeline_size(plan: ir.Plan, shapes: Shapes) -> int:
    """The size of the pipeline's dim (1 without a pipeline)."""
    if plan.pipeline is None:
        return 1
    return dim_sizes(plan, shapes)[(plan.pipeline.mesh.mesh, plan.pipeline.mesh.dims[0])]
