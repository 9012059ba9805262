"""Where tensors live (SL208, SL209): cpu and cuda meshes on one module, `init meta` without an init method."""

from __future__ import annotations

from ...frontend import ir
from ...frontend.diagnostics import SL208, SL209, Diagnostic, few
from ..initialisers import covered
from ..predict import enclosing, units_by_module
from ..resolve import Resolution
from .common import Predictions, Shapes, unit_span


def mixed_device_meshes(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL208: one module's tensors placed by a cpu mesh and a cuda mesh."""
    devices = {m.name: m.device for m in plan.meshes}
    units = units_by_module(resolution)
    found, reported = [], set()
    for match in resolution.rules:
        unit = enclosing(match.fqn, units)
        if unit is None:
            continue
        tp_mesh, dp_mesh = plan.parallelize[match.block].mesh.mesh, plan.units[unit.block].mesh.mesh
        pair = {devices[tp_mesh], devices[dp_mesh]}
        if pair == {"cpu", "cuda"} and (match.fqn, unit.fqn) not in reported:
            reported.add((match.fqn, unit.fqn))
            found.append(
                Diagnostic(
                    SL208,
                    f"module '{match.fqn or 'root'}' is parallelized on mesh '{tp_mesh}' ({devices[tp_mesh]}) "
                    f"and sharded on mesh '{dp_mesh}' ({devices[dp_mesh]})",
                    match.rule.span,
                    (
                        f"the {plan.units[unit.block].kind} unit is at line {unit_span(plan, unit).line}; use one device type",
                    ),
                )
            )
    return found


def uninitialised_on_meta(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL209: `init meta` leaves garbage in parameters that no initialiser covers (buffers are built real
    and keep what the constructor computed)."""
    if plan.init.mode != "meta":
        return []
    method = plan.init.method
    missing = [
        fqn or type(m).__name__
        for fqn, m in resolution.modules.items()
        if any(p is not None for p in m._parameters.values()) and not covered(resolution.modules, fqn, method)
    ]
    if not missing:
        return []
    named = (
        f"{method}()" if method else "init method (reset_parameters, _reset_parameters, or the model's _init_weights)"
    )
    return [
        Diagnostic(
            SL209,
            f"init meta: {len(missing)} module{'s have' if len(missing) > 1 else ' has'} parameters but no "
            f"{named}, so they stay uninitialised",
            plan.init.span,
            (
                f"without one: {few(missing)}",
                "give them reset_parameters(), or name a method that initialises them: init meta with <method>",
            ),
        )
    ]
