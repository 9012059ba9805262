"""What the lint rules share: mesh dim sizes and where a unit is written."""

from __future__ import annotations

from ...frontend import ir
from ...frontend.source import Span
from ..resolve import UnitMatch


def dim_sizes(plan: ir.Plan, shapes: dict[str, tuple[int, ...]]) -> dict[tuple[str, str], int]:
    """(mesh, dim) -> size at this world size."""
    return {(m.name, d): n for m in plan.meshes for d, n in zip(m.dim_names, shapes[m.name])}


def unit_span(plan: ir.Plan, unit: UnitMatch) -> Span:
    """Where a unit is written: its `each`, or its block for the implicit root unit."""
    return unit.unit.span if unit.unit is not None else plan.units[unit.block].span


def pipeline_size(plan: ir.Plan, shapes: dict[str, tuple[int, ...]]) -> int:
    """The size of the pipeline's dim (1 without a pipeline)."""
    if plan.pipeline is None:
        return 1
    return dim_sizes(plan, shapes)[(plan.pipeline.mesh.mesh, plan.pipeline.mesh.dims[0])]
