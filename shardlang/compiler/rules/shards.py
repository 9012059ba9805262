"""How tensors split (SL203, SL204, SL301): uneven shards, those torch cannot run, and tied parameters placed
or sharded apart."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn

from ...frontend import ir
from ...frontend.diagnostics import SL203, SL204, SL301, Diagnostic, few
from ...frontend.source import Span
from ..predict import enclosing, owned, rules_by_module, style_kind, units_by_module
from ..resolve import Resolution
from ..torchlimits import ROWWISE_UNEVEN_LOCAL_INPUT, cannot
from .common import Predictions, Shapes, dim_sizes, unit_span


def uneven_shards(plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes) -> list[Diagnostic]:
    """SL203: a sharded dim not divisible by its mesh dim size (TP per rule, FSDP per unit)."""
    sizes = dim_sizes(plan, shapes)
    tensors = dict((fqn, t) for fqn, _, _, t in owned(resolution.modules))
    rules = rules_by_module(resolution)
    units = units_by_module(resolution)
    by_origin: dict[tuple, list[str]] = defaultdict(list)
    for fqn, placed in predictions.items():
        if not placed.known or placed.mesh is None:
            continue
        full = list(tensors[fqn].shape)
        shape = list(full)
        owner = fqn.rpartition(".")[0]
        split_by: dict[int, list[str]] = defaultdict(list)
        # Walk the mesh dims in the order the shards are taken: DTensor's order, except that a
        # _StridedShard (FSDP over a TP-sharded dim) splits what the later dims' shards left, so it comes
        # after them: FSDP's 16 rows of a 32-row colwise weight at tp=2 over dp=3, not 32 over dp=3.
        order = sorted(range(len(placed.dims)), key=lambda i: isinstance(placed.placements[i], ir.StridedShard))
        for i in order:
            dim, placement = placed.dims[i], placed.placements[i]
            if not isinstance(placement, (ir.Shard, ir.StridedShard)):
                continue
            n = sizes[(placed.mesh, dim)]
            d = placement.dim % len(shape)
            if shape[d] % n:
                origin = _origin(plan, rules, units, owner, placed.mesh, dim)
                if origin is not None:
                    of = f" ({full[d]} split by {', '.join(split_by[d])})" if split_by[d] else ""
                    by_origin[origin].append(f"{fqn} dim {d}: {shape[d]}{of} over {dim}={n}")
            shape[d] = -(-shape[d] // n)
            split_by[d].append(f"{dim}={n}")
    return [
        Diagnostic(
            SL203,
            f"uneven shards: {len(items)} tensor{'s' if len(items) > 1 else ''} not divisible by the mesh dim",
            span,
            (few(items), "DTensor and FSDP pad uneven shards; pick sizes that divide to avoid the padding"),
        )
        for (span, _), items in by_origin.items()
    ]


def unrunnable_shards(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL301: uneven TP shards that the installed torch cannot run (torchlimits.py): a rowwise nn.Linear
    whose in_features do not divide by the TP size while its input comes as a local `shard(-1)` tensor.
    A block where some colwise layer keeps a DTensor output (`local_output=false`) is left to SL203:
    a DTensor input carries its uneven shape, and torch runs it."""
    if not cannot(ROWWISE_UNEVEN_LOCAL_INPUT):
        return []
    sizes = dim_sizes(plan, shapes)
    keeps_dtensor = {
        match.block
        for match in resolution.rules
        if style_kind(match.rule.style) == "colwise" and match.rule.style.get("local_output") is False
    }
    found: dict[ir.Rule, list[str]] = defaultdict(list)
    sized: dict[ir.Rule, int] = {}
    for match in resolution.rules:
        style, module = match.rule.style, resolution.modules[match.fqn]
        if style.use is not None or style.name != "rowwise" or not isinstance(module, nn.Linear):
            continue
        if match.block in keeps_dtensor or style.get("input", ir.Shard(-1)) != ir.Shard(-1):
            continue
        mesh = plan.parallelize[match.block].mesh
        n = 1
        for dim in mesh.dims:
            n *= sizes[(mesh.mesh, dim)]
        if n > 1 and module.in_features % n:
            found[match.rule].append(f"'{match.fqn}' has {module.in_features}")
            sized[match.rule] = n
    version = torch.__version__.split("+")[0]
    return _uneven_packed_fsdp(plan, resolution, predictions, sizes) + [
        Diagnostic(
            SL301,
            f"torch {version} cannot run this rowwise layer at tp={sized[rule]}: in_features not divisible "
            f"by {sized[rule]} ({few(items)})",
            rule.span,
            (
                "RowwiseParallel rebuilds its shard(-1) input from each rank's local tensor assuming equal "
                'chunks, so the matmul fails ("a and b must have same reduction dim")',
                "use a TP size that divides in_features, or give the layer `input=replicate`, or keep the "
                "previous colwise layer's output a DTensor (`local_output=false`)",
            ),
        )
        for rule, items in found.items()
    ]


def _uneven_packed_fsdp(plan, resolution, predictions, sizes) -> list[Diagnostic]:
    """SL301 too: FSDP2 shards a packed_colwise weight on dim 1 (predict._fsdp), and FSDP2 shards a dim
    other than 0 only evenly ("FSDP does not support uneven sharding on dim 1")."""
    tensors = {fqn: t for fqn, _, _, t in owned(resolution.modules, buffers=False)}
    units = units_by_module(resolution)
    found: dict[tuple, list[str]] = defaultdict(list)
    for fqn, placed in predictions.items():
        if fqn not in tensors or not any(isinstance(p, ir.StridedShard) for p in placed.placements):
            continue
        for dim, placement in zip(placed.dims, placed.placements):
            n = sizes[(placed.mesh, dim)]
            if placement == ir.Shard(1) and tensors[fqn].shape[1] % n:
                unit = enclosing(fqn.rpartition(".")[0], units)
                found[(unit_span(plan, unit), dim, n)].append(f"{fqn} has {tensors[fqn].shape[1]}")
    return [
        Diagnostic(
            SL301,
            f"fully_shard cannot shard a packed_colwise weight over {dim}={n}: its dim 1 does not divide ({few(items)})",
            span,
            (
                "FSDP2 shards a packed_colwise weight on dim 1 (its input features), and a dim other than 0 "
                "only evenly",
                f"use a {dim} size that divides the layer's in_features",
            ),
        )
        for (span, dim, n), items in found.items()
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


def tied_parameters(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL204: one Parameter under several names that the plan would place differently or shard in two units.
    Placements are compared only where both are predicted: a `use` style's are known once apply has run
    it in a simulated world (predict.Observed), and plain lint, which runs none, says nothing of them."""
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
            if a.known and b.known and a != b:
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
