"""The compiler's prediction of where every parameter and buffer ends up: mesh, dims and placements.

This is what the `placements` check compares against, what SL203/SL204 reason about, and what
`explain` shows. It is derived from the plan's styles and units, not by running them, so a style that
shards differently from what it claims is caught. Predictions follow the installed torch where it
matters (`strided_shard`, which apply takes from runtime.torchcompat.fsdp_strided_shard), so this
module needs no process group and imports nothing of torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch.nn as nn
from attrs import frozen

from ..frontend import ir
from .resolve import Resolution, RuleMatch, UnitMatch
from .styles import expand

#: TP styles by what they do to parameters; user styles are mapped by their torch base class.
SHARDING_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "packed_colwise",
    "colwise_conv1d",
    "rowwise_conv1d",
)
#: Styles that make every parameter of the module itself (not of its children) a Replicate DTensor.
REPLICATING_STYLES = ("sequence_parallel", "replicated_with_grad_allreduce")
INPUT_OUTPUT_STYLES = ("prepare_input", "prepare_output")


@frozen
class Placed:
    """A tensor's predicted layout. `mesh` None: a plain tensor. `known` False: a user style shardlang
    cannot see into placed it, so there is no prediction to check against."""

    mesh: str | None = None
    dims: tuple[str, ...] = ()
    placements: tuple = ()
    known: bool = True

    def __str__(self) -> str:
        if not self.known:
            return "unknown (user style)"
        if self.mesh is None:
            return "plain tensor"
        return f"{self.mesh}[{', '.join(self.dims)}] ({', '.join(map(_placement_text, self.placements))})"


def _placement_text(p) -> str:
    return {ir.Replicate: "Replicate()", ir.Partial: "Partial()"}.get(type(p)) or (
        f"Shard({p.dim})" if isinstance(p, ir.Shard) else str(p)
    )


PLAIN = Placed()
UNKNOWN = Placed(known=False)


def style_kind(style: ir.Style, user_kinds: Mapping[str, str] | None = None) -> str:
    """`colwise`, `rowwise`, `sequence_parallel`, `distribute`, `prepare_input`, `prepare_output` or `unknown`.
    A `use` style has the kind `user_kinds` gives its alias (runtime.values.style_kinds, from the
    imported class's torch base class), else `unknown`."""
    if style.use is None:
        return style.name
    return (user_kinds or {}).get(style.name, "unknown")


def tp_placement(style: ir.Style, kind: str, module: nn.Module, name: str):
    """The placement a TP style gives a module's own tensor `name` on its 1-D mesh; None if it does not
    shard it (torch's distribute_module then replicates it)."""
    kind = expand(style).name if style.use is None else kind
    if kind == "packed_colwise":
        # each part split on its own: rank k holds the k-th slice of every part; a bias stays whole
        return {"weight": ir.StridedShard(0, style.get("parts", 2)), "bias": ir.Replicate()}.get(name)
    if kind in ("colwise_conv1d", "rowwise_conv1d"):  # weight stored [in, out]: the sharded dims swap
        colwise = kind == "colwise_conv1d"
        return {"weight": ir.Shard(1 if colwise else 0), "bias": ir.Shard(0) if colwise else ir.Replicate()}.get(name)
    if kind == "colwise":
        if isinstance(module, nn.Embedding):
            return ir.Shard(1) if name == "weight" else None
        return ir.Shard(0) if name in ("weight", "bias") else None
    if kind == "rowwise":
        if isinstance(module, nn.Embedding):
            return ir.Shard(0) if name == "weight" else None
        return {"weight": ir.Shard(1), "bias": ir.Replicate()}.get(name)
    return None


def owned(model_modules: Mapping[str, nn.Module], buffers: bool = True) -> Iterator[tuple[str, str, str, object]]:
    """(tensor FQN, owner module FQN, local name, tensor) for every parameter (and buffer), tied ones
    under each of their names."""
    for fqn, module in model_modules.items():
        prefix = fqn + "." if fqn else ""
        for name, p in module._parameters.items():
            if p is not None:
                yield prefix + name, fqn, name, p
        if buffers:
            for name, b in module._buffers.items():
                if b is not None:
                    yield prefix + name, fqn, name, b


def enclosing(fqn: str, candidates: Mapping[str, object]):
    """The candidate at `fqn` or its nearest ancestor (longest prefix), or None."""
    probe = fqn
    while True:
        if probe in candidates:
            return candidates[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


def rules_by_module(resolution: Resolution) -> dict[str, RuleMatch]:
    """The first rule that matched each module (lint reports any second one as SL201)."""
    rules: dict[str, RuleMatch] = {}
    for match in resolution.rules:
        rules.setdefault(match.fqn, match)
    return rules


def units_by_module(resolution: Resolution) -> dict[str, UnitMatch]:
    units: dict[str, UnitMatch] = {}
    for match in resolution.units:
        units.setdefault(match.fqn, match)
    return units


def mesh_shapes(plan: ir.Plan, world_size: int) -> dict[str, tuple[int, ...]]:
    return {m.name: m.shape(world_size) for m in plan.meshes}


def predict(
    plan: ir.Plan,
    resolution: Resolution,
    mesh_sizes: Mapping[str, tuple[int, ...]],
    user_kinds: Mapping[str, str] | None = None,
    strided_shard: bool = True,
) -> dict[str, Placed]:
    """Every parameter's and buffer's predicted layout by FQN. `mesh_sizes` maps each mesh to its shape;
    `strided_shard`: FSDP marks its shard of a dim TP already shards as `_StridedShard`, as every torch
    shardlang supports does (runtime.torchcompat.fsdp_strided_shard)."""
    rules = rules_by_module(resolution)
    units = units_by_module(resolution)
    predictions = {}
    for fqn, owner, name, tensor in owned(resolution.modules):
        is_param = isinstance(tensor, nn.Parameter)
        placed = _tp(plan, rules, resolution, owner, name, is_param, user_kinds)
        if is_param:
            unit = enclosing(owner, units)
            if unit is not None and unit.kind(plan.units[unit.block]) == "fully_shard" and placed.known:
                placed = _fsdp(plan, plan.units[unit.block].mesh, placed, mesh_sizes, strided_shard)
        predictions[fqn] = placed
    return predictions


def _tp(plan, rules, resolution, owner, name, is_param, user_kinds) -> Placed:
    """The layout after tensor parallelism: from the rule on the owner, or a recursive rule above it."""
    probe = owner
    while True:
        match = rules.get(probe)
        if match is not None:
            kind = style_kind(match.rule.style, user_kinds)
            mesh = plan.parallelize[match.block].mesh
            if probe == owner and kind in SHARDING_STYLES:
                # what the style does not shard, distribute_module replicates (an embedding's scale buffer)
                placement = tp_placement(match.rule.style, kind, resolution.modules[owner], name) or ir.Replicate()
                return Placed(mesh.mesh, mesh.dims, (placement,))
            if kind in REPLICATING_STYLES and is_param or kind == "distribute":
                return Placed(mesh.mesh, mesh.dims, (ir.Replicate(),))
            if kind == "unknown":  # a user style may place anything below it
                return UNKNOWN
        if not probe:
            return PLAIN
        probe = probe.rpartition(".")[0]


def _fsdp(
    plan: ir.Plan, dp: ir.MeshRef, tp: Placed, mesh_sizes: Mapping[str, tuple[int, ...]], strided_shard: bool
) -> Placed:
    """FSDP2 over `tp`: dp shard dim -> Shard(0) (or _StridedShard when a later TP dim also shards dim 0;
    Shard(1) for a weight packed_colwise splits part by part, as runtime.tpstyles.fsdp_shard_placement
    has FSDP do), HSDP's replicate dim -> Replicate, TP dims unchanged; dims in the mesh's own order."""
    mesh = plan.mesh(dp.mesh)
    sizes = dict(zip(mesh.dim_names, mesh_sizes[dp.mesh]))
    tp_dims = dict(zip(tp.dims, tp.placements)) if tp.mesh == dp.mesh else {}
    replicate_dims = dp.dims[:-1]  # HSDP: [replicate, shard]
    dims = tuple(d for d in mesh.dim_names if d in dp.dims or d in tp_dims)
    if tp.mesh is not None and tp.mesh != dp.mesh:
        return UNKNOWN
    packed = any(isinstance(p, ir.StridedShard) for p in tp_dims.values())
    placements = []
    for i, d in enumerate(dims):
        if d in tp_dims:
            placements.append(tp_dims[d])
        elif d in replicate_dims:
            placements.append(ir.Replicate())
        elif packed:
            placements.append(ir.Shard(1))
        else:
            later = [dims[j] for j in range(i + 1, len(dims)) if _shards_dim0(tp_dims.get(dims[j]))]
            factor = 1
            for j in later:
                factor *= sizes[j]
            strided = factor > 1 and strided_shard
            placements.append(ir.StridedShard(0, factor) if strided else ir.Shard(0))
    return Placed(dp.mesh, dims, tuple(placements))


def _shards_dim0(placement) -> bool:
    return isinstance(placement, (ir.Shard, ir.StridedShard)) and placement.dim == 0
