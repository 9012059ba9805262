"""Data parallelism that misses parameters (SL206): parameters outside every unit while a data-parallel dim > 1."""

from __future__ import annotations

from ...frontend import ir
from ...frontend.diagnostics import SL206, Diagnostic, few
from ..predict import enclosing, owned, units_by_module
from ..resolve import Resolution
from .common import Predictions, Shapes, dim_sizes
from .meshes import used_dims


def unsynchronised_gradients(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL206: parameters no unit covers while some data-parallel dim (one no parallelize block uses) > 1."""
    sizes = dim_sizes(plan, shapes)
    tp_dims = {(b.mesh.mesh, d) for b in plan.parallelize for d in b.mesh.dims}
    if plan.pipeline is not None:  # a pipeline's ranks hold different stages: not data parallelism
        tp_dims.add((plan.pipeline.mesh.mesh, plan.pipeline.mesh.dims[0]))
    used = {b.mesh.mesh for b in plan.parallelize} | {u.mesh.mesh for u in plan.units}
    named = used_dims(plan)  # a dim no statement names is SL217's: its ranks average nothing at all
    dp = [
        f"{m}.{d}={n}"
        for (m, d), n in sizes.items()
        if m in used and (m, d) not in tp_dims and (m, d) in named and n > 1
    ]
    if not dp:
        return []
    units = units_by_module(resolution)
    seen, uncovered = set(), []
    for fqn, owner, _, tensor in owned(resolution.modules, buffers=False):
        if id(tensor) not in seen and enclosing(owner, units) is None:
            uncovered.append(fqn)
        seen.add(id(tensor))
    if not uncovered:
        return []
    span = plan.units[0].span if plan.units else next(m.span for m in plan.meshes if m.name in used)
    hint = "wrap them: `each <module>` in a fully_shard or replicate block, or keep the root unit (no `root = false`)"
    return [
        Diagnostic(
            SL206,
            f"{len(uncovered)} parameter{'s are' if len(uncovered) > 1 else ' is'} outside every fully_shard/replicate "
            f"unit while {', '.join(dp)} is data-parallel: their gradients are never synchronised",
            span,
            (f"outside every unit: {few(uncovered)}", hint),
        )
    ]
