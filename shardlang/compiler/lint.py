"""Model-aware checks (SL200-SL209): the plan against a real module tree at a given world size.

Needs no process group and no GPU: the model may be built on the meta device, and mesh sizes come
from the plan and the world size, so `--world 1024` lints in one CPU process.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch.nn as nn
from attrs import frozen

from ..frontend import ir
from ..frontend.diagnostics import Diagnostic
from ..frontend.source import Span
from ..frontend.static_checks import check_world
from .predict import (
    INPUT_OUTPUT_STYLES,
    Placed,
    enclosing,
    mesh_shapes,
    owned,
    predict,
    rules_by_module,
    style_kind,
    units_by_module,
)
from .resolve import Resolution, RuleMatch, UnitMatch, resolve

#: How many names a diagnostic lists before it says how many more there are.
LISTED = 6


@frozen
class Linted:
    """A plan checked against one model: its resolution and predictions (when resolvable) and every diagnostic."""

    resolution: Resolution | None
    predictions: dict[str, Placed] | None
    diagnostics: tuple[Diagnostic, ...]

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)


def lint(
    plan: ir.Plan,
    model: nn.Module,
    world_size: int,
    user_kinds: Mapping[str, str] | None = None,
    strided_shard: bool = True,
) -> Linted:
    """Resolve `plan` on `model`, predict placements at `world_size` and run every SL2xx check.
    `user_kinds` and `strided_shard` are what apply knows of the installed torch (see predict)."""
    found = list(check_world(plan, world_size))
    if found:
        return Linted(None, None, tuple(found))
    resolution, found = resolve(plan, model)
    shapes = mesh_shapes(plan, world_size)
    predictions = predict(plan, resolution, shapes, user_kinds, strided_shard)
    for rule in RULES:
        found += rule(plan, resolution, predictions, shapes)
    return Linted(resolution, predictions, tuple(found))


def _sizes(plan: ir.Plan, shapes: dict[str, tuple[int, ...]]) -> dict[tuple[str, str], int]:
    return {(m.name, d): n for m in plan.meshes for d, n in zip(m.dim_names, shapes[m.name])}


def _unit_span(plan: ir.Plan, unit: UnitMatch) -> Span:
    return unit.unit.span if unit.unit is not None else plan.units[unit.block].span


def _few(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:LISTED])
    return shown + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


# --- the rules, each (plan, resolution, predictions, mesh shapes) -> diagnostics ------------------


def duplicate_matches(plan, resolution, predictions, shapes) -> list[Diagnostic]:
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
            "SL201",
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
        earlier = units.get((kind, unit.fqn))
        if earlier is not None:
            where = (
                f"`each {earlier.unit.target}` at line {earlier.unit.span.line}"
                if earlier.unit
                else f"the root unit at line {_unit_span(plan, earlier).line}"
            )
            found.append(
                Diagnostic(
                    "SL201",
                    f"module '{unit.fqn or 'root'}' is made a {kind} unit twice",
                    _unit_span(plan, unit),
                    (f"the first is {where}",),
                    label="second match",
                )
            )
        units[(kind, unit.fqn)] = unit
    return found


def _modules(fqns: list[str]) -> str:
    """`'a' is` or `'a' (and 3 more) are`: the modules a diagnostic is about."""
    if len(fqns) == 1:
        return f"module '{fqns[0]}' is"
    return f"modules '{fqns[0]}' and {len(fqns) - 1} more are"


def unit_conflicts(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL205: one module both a fully_shard unit and a replicate unit."""
    by_kind = defaultdict(dict)
    for unit in resolution.units:
        by_kind[unit.kind(plan.units[unit.block])].setdefault(unit.fqn, unit)
    found = []
    for fqn, rep in by_kind["replicate"].items():
        fs = by_kind["fully_shard"].get(fqn)
        if fs is not None:
            found.append(
                Diagnostic(
                    "SL205",
                    f"module '{fqn or 'root'}' is both a fully_shard unit and a replicate unit",
                    _unit_span(plan, rep),
                    (f"the fully_shard unit is at line {_unit_span(plan, fs).line}",),
                )
            )
    return found


def style_module_types(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL202: colwise/rowwise on anything but Linear and Embedding; sequence_parallel on a container.
    One diagnostic per rule."""
    wrong: dict[ir.Rule, list] = defaultdict(list)
    for match in resolution.rules:
        module = resolution.modules[match.fqn]
        kind = style_kind(match.rule.style)
        if kind in ("colwise", "rowwise") and not isinstance(module, (nn.Linear, nn.Embedding)):
            wrong[match.rule].append(
                (match.fqn, module, f"{kind} shards nn.Linear and nn.Embedding only; match their submodules instead")
            )
        elif kind == "sequence_parallel":
            nested = [n for n, p in module.named_parameters() if "." in n]
            if nested:
                why = f"sequence_parallel is for norms and dropout; parameters below it: {_few(nested)}"
                wrong[match.rule].append((match.fqn, module, why))
    found = []
    for rule, items in wrong.items():
        fqn, module, why = items[0]
        more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
        found.append(
            Diagnostic(
                "SL202",
                f"{rule.style.name} does not apply to '{fqn or 'root'}' ({type(module).__name__}){more}",
                rule.style.span,
                (why,),
            )
        )
    return found


def uneven_shards(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL203: a sharded dim not divisible by its mesh dim size (TP per rule, FSDP per unit)."""
    sizes = _sizes(plan, shapes)
    tensors = dict((fqn, t) for fqn, _, _, t in owned(resolution.modules))
    rules = rules_by_module(resolution)
    units = units_by_module(resolution)
    by_origin: dict[tuple, list[str]] = defaultdict(list)
    for fqn, placed in predictions.items():
        if not placed.known or placed.mesh is None:
            continue
        shape = list(tensors[fqn].shape)
        owner = fqn.rpartition(".")[0]
        # Walk mesh dims in order, as DTensor does: each shard splits what earlier dims left.
        for dim, placement in zip(placed.dims, placed.placements):
            if not isinstance(placement, (ir.Shard, ir.StridedShard)):
                continue
            n = sizes[(placed.mesh, dim)]
            d = placement.dim % len(shape)
            if shape[d] % n:
                origin = _origin(plan, rules, units, owner, placed.mesh, dim)
                if origin is not None:
                    by_origin[origin].append(f"{fqn} dim {d}: {shape[d]} over {dim}={n}")
            shape[d] = -(-shape[d] // n)
    return [
        Diagnostic(
            "SL203",
            f"uneven shards: {len(items)} tensor{'s' if len(items) > 1 else ''} not divisible by the mesh dim",
            span,
            (_few(items), "DTensor and FSDP pad uneven shards; pick sizes that divide to avoid the padding"),
        )
        for (span, _), items in by_origin.items()
    ]


def _origin(plan, rules, units, owner, mesh, dim) -> tuple[Span, str] | None:
    """The plan item that shards a tensor of `owner` along `mesh.dim`: its TP rule or its FSDP unit."""
    probe = owner
    while True:
        match = rules.get(probe)
        if match is not None and plan.parallelize[match.block].mesh.dims == (dim,):
            return match.rule.span, dim
        if not probe:
            break
        probe = probe.rpartition(".")[0]
    unit = enclosing(owner, units)
    if unit is not None:
        return _unit_span(plan, unit), dim
    return None


def tied_parameters(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL204: one Parameter under several names that the plan would place differently or shard in two units."""
    groups = defaultdict(list)
    for fqn, owner, _name, tensor in owned(resolution.modules, buffers=False):
        groups[id(tensor)].append((fqn, owner))
    rules = rules_by_module(resolution)
    units = units_by_module(resolution)
    found = []
    for members in groups.values():
        if len(members) < 2:
            continue
        (first, first_owner), *rest = members
        for other, other_owner in rest:
            a, b = predictions[first], predictions[other]
            span = _span_for(plan, rules, units, other_owner) or _span_for(plan, rules, units, first_owner)
            if a != b:
                found.append(
                    Diagnostic(
                        "SL204",
                        f"tied parameters '{first}' and '{other}' would get different placements",
                        span,
                        (
                            f"{first}: {a}",
                            f"{other}: {b}",
                            "give both modules styles that shard the shared weight alike",
                        ),
                    )
                )
                continue
            ua, ub = enclosing(first_owner, units), enclosing(other_owner, units)
            if (
                ua is not None
                and ub is not None
                and ua.fqn != ub.fqn
                and "fully_shard" in (ua.kind(plan.units[ua.block]), ub.kind(plan.units[ub.block]))
            ):
                found.append(
                    Diagnostic(
                        "SL204",
                        f"tied parameters '{first}' and '{other}' would be sharded by two different units",
                        span,
                        (
                            f"'{first}' is in the unit at '{ua.fqn or 'root'}', '{other}' in the unit at '{ub.fqn or 'root'}'",
                            "put both modules under one unit (for example the root)",
                        ),
                    )
                )
    return found


def _span_for(plan, rules, units, owner) -> Span | None:
    match = rules.get(owner)
    if match is not None:
        return match.rule.span
    unit = enclosing(owner, units)
    return _unit_span(plan, unit) if unit is not None else None


def unsynchronised_gradients(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL206: parameters no unit covers while some data-parallel dim (one no parallelize block uses) > 1."""
    sizes = _sizes(plan, shapes)
    tp_dims = {(b.mesh.mesh, d) for b in plan.parallelize for d in b.mesh.dims}
    used = {b.mesh.mesh for b in plan.parallelize} | {u.mesh.mesh for u in plan.units}
    dp = [f"{m}.{d}={n}" for (m, d), n in sizes.items() if m in used and (m, d) not in tp_dims and n > 1]
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
            "SL206",
            f"{len(uncovered)} parameter{'s are' if len(uncovered) > 1 else ' is'} outside every fully_shard/replicate "
            f"unit while {', '.join(dp)} is data-parallel: their gradients are never synchronised",
            span,
            (f"outside every unit: {_few(uncovered)}", hint),
        )
    ]


def loss_parallel_output(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL207: loss_parallel needs an output layer that leaves class-sharded logits as a DTensor."""
    if plan.loss_parallel is None:
        return []
    for match in resolution.rules:
        style = match.rule.style
        if (
            style_kind(style) == "colwise"
            and style.get("output") == ir.Shard(-1)
            and style.get("local_output") is False
        ):
            return []
    return [
        Diagnostic(
            "SL207",
            "loss_parallel needs an output layer with colwise(output=shard(-1), local_output=false)",
            plan.loss_parallel,
            ("the loss is computed on logits sharded over the classes; give the model's output layer that style",),
        )
    ]


def mixed_device_meshes(plan, resolution, predictions, shapes) -> list[Diagnostic]:
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
                    "SL208",
                    f"module '{match.fqn or 'root'}' is parallelized on mesh '{tp_mesh}' ({devices[tp_mesh]}) "
                    f"and sharded on mesh '{dp_mesh}' ({devices[dp_mesh]})",
                    match.rule.span,
                    (
                        f"the {plan.units[unit.block].kind} unit is at line {_unit_span(plan, unit).line}; use one device type",
                    ),
                )
            )
    return found


def uninitialised_on_meta(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL209: `init meta` leaves garbage in tensors whose module has no init method."""
    if plan.init.mode != "meta":
        return []
    method = plan.init.method
    missing = [
        fqn or type(m).__name__
        for fqn, m in resolution.modules.items()
        if (any(p is not None for p in m._parameters.values()) or any(b is not None for b in m._buffers.values()))
        and not callable(getattr(m, method, None))
    ]
    if not missing:
        return []
    return [
        Diagnostic(
            "SL209",
            f"init meta: {len(missing)} module{'s have' if len(missing) > 1 else ' has'} parameters or buffers "
            f"but no {method}(), so they stay uninitialised",
            plan.init.span,
            (
                f"without {method}(): {_few(missing)}",
                f"give them {method}(), or name another method: init meta with <method>",
            ),
        )
    ]


RULES = (
    duplicate_matches,
    unit_conflicts,
    style_module_types,
    uneven_shards,
    tied_parameters,
    unsynchronised_gradients,
    loss_parallel_output,
    mixed_device_meshes,
    uninitialised_on_meta,
)
