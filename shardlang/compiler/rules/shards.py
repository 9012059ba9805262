"""How tensors split (SL203, SL204): uneven shards, and tied parameters placed or sharded apart."""

from __future__ import annotations

from collections import defaultdict

from ...frontend import ir
from ...frontend.diagnostics import SL203, SL204, Diagnostic, few
from ...frontend.source import Span
from ..predict import enclosing, owned, rules_by_module, units_by_module
from .common import dim_sizes, unit_span


def uneven_shards(plan, resolution, predictions, shapes) -> list[Diagnostic]:
    """SL203: a sharded dim not divisible by its mesh dim size (TP per rule, FSDP per unit)."""
    sizes = dim_sizes(plan, shapes)
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
            SL203,
            f"uneven shards: {len(items)} tensor{'s' if len(items) > 1 else ''} not divisible by the mesh dim",
            span,
            (few(items), "DTensor and FSDP pad uneven shards; pick sizes that divide to avoid the padding"),
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
        return unit_span(plan, unit), dim
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
                        SL204,
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
                        SL204,
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
    return unit_span(plan, unit) if unit is not None else None
