"""Mesh dims that nothing uses (SL217), and dims used for two kinds of parallelism at once (SL218).

Every statement that spreads the model over ranks names the dims it spreads it over: `parallelize`
(tensor parallelism), `fully_shard` and `replicate` (data parallelism, which averages gradients),
`pipeline`, and `sync over` (module states made equal). The ranks along a dim that none of them names
hold the same model, are handed different data (the data-parallel replicas are the ranks of the dims no
parallelize block or pipeline uses), and never average their gradients: they drift apart from the first
step. `shardlang init --tp N` wrote such a dim for models without a TP plan of their own.
"""

from __future__ import annotations

from ...frontend import ir
from ...frontend.diagnostics import SL217, SL218, SL219, Diagnostic
from ..resolve import Resolution
from .common import Predictions, Shapes, dim_sizes


def used_dims(plan: ir.Plan) -> set[tuple[str, str]]:
    """(mesh, dim) for every dim some statement names."""
    refs = [b.mesh for b in plan.parallelize] + [u.mesh for u in plan.units] + [s.mesh for s in plan.syncs]
    if plan.pipeline is not None:
        refs.append(plan.pipeline.mesh)
    if plan.context_parallel is not None:
        refs.append(plan.context_parallel.mesh)
    return {(ref.mesh, dim) for ref in refs for dim in ref.dims}


def unused_dims(plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes) -> list[Diagnostic]:
    """SL217: a dim larger than 1 of a mesh the model runs on that no statement names. A mesh no statement
    names at all is not one the model runs on (unless it is the only candidate: the first mesh of a plan
    whose statements name none), so its dims are left alone."""
    used = used_dims(plan)
    meshes = {mesh for mesh, _ in used} or ({plan.meshes[0].name} if plan.meshes else set())
    sizes = dim_sizes(plan, shapes)
    found = []
    for mesh in plan.meshes:
        if mesh.name not in meshes:
            continue
        for dim in mesh.dims:
            size = sizes[(mesh.name, dim.name)]
            if (mesh.name, dim.name) in used or size <= 1:
                continue
            found.append(
                Diagnostic(
                    SL217,
                    f"no statement uses {mesh.name}.{dim.name} (size {size}): its {size} ranks hold the same model, "
                    "train on different data and never average their gradients",
                    dim.span,
                    (
                        f"shard or replicate over it (`fully_shard on {mesh.name}.{dim.name} {{ ... }}`, "
                        f"`parallelize ... on {mesh.name}.{dim.name}`), or remove the dim (or give it size 1)",
                    ),
                )
            )
    return found


def tensor_and_data_dims(
    plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes
) -> list[Diagnostic]:
    """SL218: a dim that a `parallelize` block splits tensors over (tensor or expert parallelism: its ranks
    share their batch) and a `fully_shard` or `replicate` block also names (its ranks train on different
    data). FSDP2 and DDP cannot spread over a dim the tensors are already split on; torch fails at the first
    `fully_shard` ("Cannot concatenate overlapping meshes"). One diagnostic per data-parallel block.
    The exception: a flattened mesh (`world[dp*ep]`), or a fully_shard block over that dim alone (ep the
    only data dim, SPEC §12), over a dim that only `expert_parallel` rules split, whose experts get their
    own unit over the other dims (frontend.desugar)."""
    split = {(b.mesh.mesh, dim): b for b in plan.parallelize for dim in b.mesh.dims}
    experts_only = {
        key
        for key in split
        if all(
            r.style.builtin == "expert_parallel"
            for b in plan.parallelize
            if (b.mesh.mesh, *b.mesh.dims[:1]) == key
            for r in b.rules
        )
    }
    found = []
    for unit in plan.units:
        both = [
            dim
            for dim in unit.mesh.dims
            if (unit.mesh.mesh, dim) in split and not (_may_borrow(unit) and (unit.mesh.mesh, dim) in experts_only)
        ]
        if both:
            found.append(_split_and_data(unit, both, split[(unit.mesh.mesh, both[0])], experts_only))
    return found


def _split_and_data(unit: ir.Units, both: list[str], block: ir.Parallelize, experts_only: set) -> Diagnostic:
    """SL218 for one data-parallel block; a replicate block over an ep dim says why it cannot borrow it."""
    names = ", ".join(f"{unit.mesh.mesh}.{dim}" for dim in both)
    where = f"the parallelize block: {block.mesh.span.file}:{block.mesh.span.line}:{block.mesh.span.col}"
    if unit.kind == "replicate" and unit.mesh.flat and all((unit.mesh.mesh, d) in experts_only for d in both):
        return Diagnostic(
            SL218,
            f"replicate on {unit.mesh} cannot borrow {names}, which expert_parallel splits the experts over: "
            "DDP would average the gradients of different experts across its ranks",
            unit.mesh.span,
            (
                where,
                f"shard with FSDP instead (`fully_shard on {unit.mesh}`: the experts get their own unit, their "
                f"gradients averaged over every data rank), or replicate over {_others(unit.mesh, both)} alone "
                "(the ep ranks then share their batch)",
            ),
        )
    return Diagnostic(
        SL218,
        f"{unit.kind} on {unit.mesh} spreads over {names}, which a parallelize block already splits the tensors over",
        unit.mesh.span,
        (
            where,
            "give data parallelism its own dim (`mesh world = auto[dp=auto, tp=2]`: parallelize on world.tp, "
            "fully_shard on world.dp); for experts that borrow data-parallel ranks, flatten the dims "
            "(`fully_shard on world[dp*ep]`)",
        ),
    )


def _others(ref: ir.MeshRef, dims: list[str]) -> str:
    """The mesh ref of `ref`'s dims but `dims`, as a plan writes it (`world.dp`, `world[dp*cp]`)."""
    rest = tuple(d for d in ref.dims if d not in dims)
    return str(ir.MeshRef(ref.mesh, rest, ref.span, flat=len(rest) > 1)) if rest else "the other data dims"


def _may_borrow(unit: ir.Units) -> bool:
    """A data-parallel block whose experts may borrow an ep dim's ranks: a fully_shard block over a
    flattened mesh or over one dim (frontend.desugar)."""
    return unit.kind == "fully_shard" and (unit.mesh.flat or len(unit.mesh.dims) == 1)


def context_dims(plan: ir.Plan, resolution: Resolution, predictions: Predictions, shapes: Shapes) -> list[Diagnostic]:
    """SL219: context parallelism's dim split by a parallelize block too (its ranks hold shards of one
    sequence, not of the tensors), or named by no fully_shard or replicate block: each cp rank's gradients
    hold only its own tokens' part, and nothing would sum them (`fully_shard on world[dp*cp]`)."""
    cp = plan.context_parallel
    if cp is None:
        return []
    dim = cp.mesh.dims[0]
    split = next((b for b in plan.parallelize if b.mesh.mesh == cp.mesh.mesh and dim in b.mesh.dims), None)
    if split is not None:
        return [
            Diagnostic(
                SL219,
                f"{cp.mesh} splits the sequence for context_parallel, and a parallelize block splits tensors over it",
                split.mesh.span,
                ("give context parallelism a dim of its own (`mesh world = auto[dp=auto, cp=2, tp=2]`)",),
            )
        ]
    if not any(u.mesh.mesh == cp.mesh.mesh and dim in u.mesh.dims for u in plan.units):
        return [
            Diagnostic(
                SL219,
                f"no fully_shard or replicate block reduces over {cp.mesh}: each of its ranks computes the gradients "
                "of its own shard of the sequence, and nothing would sum them",
                cp.mesh.span,
                (f"shard over it with data parallelism: `fully_shard on {cp.mesh.mesh}[dp*{dim}] {{ ... }}`",),
            )
        ]
    return []
