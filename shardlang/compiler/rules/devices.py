"""Where tensors live (SL208, SL209, SL224): cpu and cuda meshes on one module, `init meta` without an init
method, or leaving parameters that no initialiser writes."""

from __future__ import annotations

from ...frontend import ir
from ...frontend.diagnostics import SL208, SL209, SL224, Diagnostic, few
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


def unwritten_under_meta(plan: ir.Plan, unwritten: list[str] | None) -> list[Diagnostic]:
    """SL224: under `init meta`, the parameters that running the model's initialisers on the meta model left
    unwritten (explain.unwritten.left_unwritten): a value its constructor computed (transformers' xIELU
    activation's alpha, a head's bias of zeros) that no `_init_weights`, `reset_parameters` or METHOD sets
    again. On the mesh they would hold whatever memory held; apply's init check fails on them. Lint's step
    (explain.rehearsal) runs it, as it runs the model's other code."""
    if plan.init.mode != "meta" or not unwritten:
        return []
    return [
        Diagnostic(
            SL224,
            f"init meta: the model's initialisers leave {len(unwritten)} parameter{'s' if len(unwritten) > 1 else ''} "
            "unwritten, which the meta device built without values: on the mesh they would hold whatever memory held",
            plan.init.span,
            (
                f"unwritten: {few(unwritten)}",
                "their values come from the constructor alone: `init rank0` (rank 0 builds the model and sends "
                "each rank its shards) or `init cpu` keeps them; or give their module reset_parameters() and "
                "name a method that sets them (init meta with <method>)",
            ),
        )
    ]
