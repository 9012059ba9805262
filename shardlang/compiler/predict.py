"""The compiler's prediction of where every parameter and buffer ends up: mesh, dims and placements.

This is what the `placements` check compares against, what SL203/SL204 reason about, and what
`explain` shows. Built-in styles are predicted from a table of what each does (tests run every one in a
simulated world and compare), not by running them, so a built-in style that shards differently from
the table is caught. A `use` style has no table: its tensors are predicted from what it did when apply
ran it on a meta copy of its module in a simulated world (`observed`, runtime.simulated), and are "not
predicted" where it was not run (plain lint) or could not be. Predictions follow the installed torch
where it matters (`strided_shard`, which apply takes from runtime.torchcompat.fsdp_strided_shard), so
this module needs no process group and imports nothing of torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch.nn as nn
from attrs import evolve, field, frozen

from ..frontend import ir
from .resolve import Resolution, RuleMatch, UnitMatch
from .styles import expand

#: Built-in TP styles by what they do to parameters.
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
    """A tensor's predicted layout. `mesh` None: a plain tensor. `known` False: no prediction to check
    against, and `note` says why (a `use` style that was not or could not be run); a known layout's
    `note` says how it was predicted when not from the table of built-in styles. Two layouts are equal
    when mesh, dims and placements are, however they were predicted."""

    mesh: str | None = None
    dims: tuple[str, ...] = ()
    placements: tuple = ()
    known: bool = True
    note: str = field(default="", eq=False)
    #: A member of experts split by `expert_parallel` (a ModuleList's or ModuleDict's): (mesh, dim, the
    #: member's index, how many members); the rank at coordinate index // (members / size) of the dim
    #: holds it whole, the others not at all.
    held: tuple[str, str, int, int] | None = field(default=None, eq=False)

    def __str__(self) -> str:
        if not self.known:
            return f"not predicted ({self.note})" if self.note else "not predicted"
        if self.mesh is None:
            return "plain tensor"
        return f"{self.mesh}[{', '.join(self.dims)}] ({', '.join(map(placement_text, self.placements))})"


def placement_text(p) -> str:
    """A placement as it prints in messages: `Shard(0)`, `Replicate()`, `Partial()`."""
    return {ir.Replicate: "Replicate()", ir.Partial: "Partial()"}.get(type(p)) or (
        f"Shard({p.dim})" if isinstance(p, ir.Shard) else str(p)
    )


PLAIN = Placed()


def unknown(note: str) -> Placed:
    """No prediction, and why."""
    return Placed(known=False, note=note)


@frozen
class Observed:
    """What one `use` style did when run on a meta copy of its module in a simulated world of the plan's
    shape (runtime.simulated): the layout it left on each parameter and buffer below that module, by
    name relative to it. `failure`: why it could not be run; nothing it places is predicted then."""

    style: str
    tensors: tuple[tuple[str, Placed], ...] = ()
    failure: str | None = None

    def placed(self, name: str) -> Placed | None:
        """The layout the style left on `name`; None if the style removed or renamed it."""
        return dict(self.tensors).get(name)


def style_kind(style: ir.Style) -> str:
    """A built-in style's name (`colwise`, `rowwise`, `sequence_parallel`, `distribute`, ...); `unknown`
    for a `use` style, which may place anything below its module."""
    return style.name if style.use is None else "unknown"


def tp_placement(style: ir.Style, module: nn.Module, name: str):
    """The placement a built-in TP style gives a module's own tensor `name` on its 1-D mesh; None if it
    does not shard it (torch's distribute_module then replicates it)."""
    kind = expand(style).name
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


def stacked_experts(module: nn.Module) -> int | None:
    """How many experts a module holds stacked on dim 0 of its 3-D weights (transformers' experts): its
    `num_experts`, else the dim 0 all its 3-D weights share. None for any other module (a router, whose 2-D
    weight also has a row per expert)."""
    own = list(module.parameters(recurse=False))
    count = getattr(module, "num_experts", None)
    if not (isinstance(count, int) and count > 0):
        firsts = {p.shape[0] for p in own if p.dim() >= 3}
        count = firsts.pop() if len(firsts) == 1 else None
    return count if count is not None and any(p.dim() >= 3 and p.shape[0] == count for p in own) else None


def takes_expert_counts(module: nn.Module) -> bool:
    """Whether a stacked-experts module's forward takes its rows already grouped by expert and each expert's
    count, torchtitan's grouped experts (`forward(x [rows, dim], num_tokens_per_expert [experts])`, two
    required arguments), rather than every token with its routing, transformers' (`forward(hidden_states,
    top_k_index, top_k_weights)`)."""
    import inspect  # (here: `compile --emit python` pastes this function)

    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len([p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]) == 2


def expert_members(module: nn.Module) -> tuple[str, ...] | None:
    """The keys, in order, of a ModuleList's or ModuleDict's experts: two or more members of one class, each
    holding parameters (transformers' SwitchTransformers experts, a model's own `nn.ModuleList` of MLPs).
    None for any other module."""
    import torch.nn as nn  # (here: `compile --emit python` pastes this function)

    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return None
    members = [(key, m) for key, m in module._modules.items() if m is not None]
    if len(members) < 2 or len({type(m) for _, m in members}) != 1:
        return None
    if not all(next(m.parameters(), None) is not None for _, m in members):
        return None
    return tuple(key for key, _ in members)


def expert_tp_layout(module: nn.Module, tp: int) -> dict[str, tuple[int | None, int]] | str:
    """How `expert_tensor_parallel` splits a stacked-experts module over `tp` ranks: {parameter: (dim,
    parts)}, or why it cannot (another layout, a width that does not divide). transformers stores the
    experts as Linear weights ([experts, out, in]): for each projection (and its bias, [experts, out]), the
    dim holding the experts' intermediate width and how many projections it packs; down_proj's bias
    ([experts, hidden]) is added once, so it stays whole (None). (A table here, not a module constant:
    `compile --emit python` pastes this function.)"""
    table = {
        "gate_up_proj": (1, 2),
        "gate_proj": (1, 1),
        "up_proj": (1, 1),
        "down_proj": (2, 1),
        "gate_up_proj_bias": (1, 2),
        "gate_proj_bias": (1, 1),
        "up_proj_bias": (1, 1),
        "down_proj_bias": (None, 1),
    }
    own = dict(module.named_parameters(recurse=False))
    down = own.get("down_proj")
    if stacked_experts(module) is None or down is None or down.dim() != 3:
        return (
            "expert_tensor_parallel splits a module holding every expert's weights stacked on dim 0 as transformers "
            "stores them (gate_up_proj [experts, 2 x width, hidden], down_proj [experts, hidden, width])"
        )
    if getattr(module, "is_transposed", False):  # transformers' use_experts_implementation(is_transposed=True)
        return (
            "its experts are stored [experts, in, out] (is_transposed, as Ergo's), which the shapes alone do "
            "not tell from [experts, out, in]: no built-in layout"
        )
    inner = next((n for n, m in module.named_children() if any(True for _ in m.parameters())), None)
    if inner is not None:  # Ergo's per-expert norm, on each expert's whole output before the routing weights
        return f"it holds '{inner}', with parameters, inside the experts' forward: no built-in layout splits it"
    hidden, width = down.shape[1], down.shape[2]
    layout = {}
    for name, param in own.items():
        if name not in table:
            return f"its parameter '{name}' is none of {', '.join(table)}: no built-in layout splits it"
        dim, parts = table[name]
        expected = {1: width * parts, 2: width}.get(dim)
        if dim is not None and (param.dim() <= dim or param.shape[dim] != expected):
            return (
                f"its {name} {list(param.shape)} is not stored as a Linear weight [experts, out, in] beside "
                f"down_proj [experts, {hidden}, {width}] (gpt-oss stores [experts, in, out]): no built-in layout"
            )
        layout[name] = (dim, parts)
    if width % tp:
        return f"its experts' intermediate width {width} does not divide by tp={tp}"
    return layout


def expert_tensors(module: nn.Module) -> tuple[str, ...]:
    """The parameters of a stacked-experts module that are split by expert, named relative to it: each whose
    dim 0 counts the experts (gpt-oss's 2-D biases too), its own and its submodules' (Ergo's per-expert norm
    scales [experts, hidden], which the module's forward indexes by the expert ids it is given: local ones,
    once split). None of any other module's."""
    experts = stacked_experts(module)
    if experts is None:
        return ()
    return tuple(n for n, p in module.named_parameters() if p.dim() >= 1 and p.shape[0] == experts)


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
    """The unit wrapping each module (every module of a `unit` over several; lint reports a second as SL201)."""
    units: dict[str, UnitMatch] = {}
    for match in resolution.units:
        for fqn in match.fqns:
            units.setdefault(fqn, match)
    return units


def mesh_shapes(plan: ir.Plan, world_size: int) -> dict[str, tuple[int, ...]]:
    return {m.name: m.shape(world_size) for m in plan.meshes}


def packs_for_fsdp(plan: ir.Plan) -> bool:
    """Whether the plan's fully_shard calls get `shard_placement_fn=fsdp_shard_placement` (lower.py), which
    shards a packed (`_StridedShard`) weight on dim 1: only where a built-in packed_colwise is used."""
    return any(r.style.name == "packed_colwise" and r.style.use is None for b in plan.parallelize for r in b.rules)


def predict(
    plan: ir.Plan,
    resolution: Resolution,
    mesh_sizes: Mapping[str, tuple[int, ...]],
    observed: Mapping[str, Observed] | None = None,
    strided_shard: bool = True,
) -> dict[str, Placed]:
    """Every parameter's and buffer's predicted layout by FQN. `mesh_sizes` maps each mesh to its shape;
    `observed`: what each `use` style did when run in a simulated world, by the FQN of its module
    (runtime.simulated.observe_user_styles; without it their tensors are not predicted);
    `strided_shard`: FSDP marks its shard of a dim TP already shards as `_StridedShard`, as every torch
    shardlang supports does (runtime.torchcompat.fsdp_strided_shard)."""
    rules = rules_by_module(resolution)
    units = units_by_module(resolution)
    predictions = {}
    for fqn, owner, name, tensor in owned(resolution.modules):
        is_param = isinstance(tensor, nn.Parameter)
        placed = _tp(plan, rules, resolution, owner, name, is_param, observed or {})
        if is_param:
            unit = enclosing(owner, units)
            if unit is not None and unit.kind(plan.units[unit.block]) == "fully_shard" and placed.known:
                sharded = _fsdp(plan, plan.units[unit.block].mesh, placed, mesh_sizes, strided_shard)
                placed = evolve(sharded, held=placed.held)
        predictions[fqn] = placed
    return predictions


def _tp(plan, rules, resolution, owner, name, is_param, observed) -> Placed:
    """The layout after tensor parallelism: from the rule on the owner, or a recursive rule above it.
    Where a `use` style and another rule would both place the tensor, which one wins depends on the
    order they run in: no prediction."""
    placers = []  # (rule's module, is a use style, layout), nearest first
    probe = owner
    while True:
        match = rules.get(probe)
        if match is not None:
            placed = _by_rule(plan, match, resolution, probe, owner, name, is_param, observed)
            if placed is not None:
                placers.append((probe, match.rule.style.use is not None, placed))
        if not probe:
            break
        probe = probe.rpartition(".")[0]
    if not placers:
        return PLAIN
    if len(placers) > 1 and any(user for _, user, _ in placers):
        unrun = next((placed for _, user, placed in placers if user and not placed.known), None)
        if unrun is not None:  # a use style above another rule, not run: it may place the tensor too
            return unrun
        where = " and ".join(f"'{m or 'root'}'" for m, _, _ in placers)
        return unknown(f"the rules on {where} would both place it, one of them a `use` style")
    return placers[0][2]


def _by_rule(plan, match: RuleMatch, resolution, probe, owner, name, is_param, observed) -> Placed | None:
    """The layout the rule on module `probe` gives `owner`'s tensor `name`; None if it leaves it alone."""
    style = match.rule.style
    mesh = plan.parallelize[match.block].mesh
    if style.use is not None:
        seen = observed.get(probe)
        if seen is None:  # plain lint imports no style and runs none
            where = "placed by" if probe == owner else f"below '{probe or 'root'}' and its"
            return unknown(f"{where} `use` style '{style.name}', which only apply runs")
        if seen.failure is not None:
            return unknown(f"the `use` style '{style.name}' could not be run in a simulated world: {seen.failure}")
        tensor = f"{owner}.{name}" if owner else name
        relative = tensor[len(probe) + 1 :] if probe else tensor
        placed = seen.placed(relative)
        if placed is None:
            return unknown(f"the `use` style '{style.name}' removed or renamed it")
        return placed if placed.mesh is not None else None
    kind = style.name
    if probe == owner and kind == "expert_tensor_parallel":
        layout = expert_tp_layout(resolution.modules[owner], 1)
        if isinstance(layout, str) or name not in layout:
            return None
        dim, parts = layout[name]
        placement = ir.Replicate() if dim is None else ir.StridedShard(dim, parts) if parts > 1 else ir.Shard(dim)
        return Placed(mesh.mesh, mesh.dims, (placement,))
    if probe != owner and kind == "expert_parallel":
        members = expert_members(resolution.modules[probe])
        inside = owner[len(probe) + 1 :] if probe else owner
        member = inside.split(".")[0]
        if members is not None and member in members:
            return Placed(held=(mesh.mesh, mesh.dims[0], members.index(member), len(members)))
        split = f"{inside}.{name}" in expert_tensors(resolution.modules[probe])  # a submodule's, split with them
        return Placed(mesh.mesh, mesh.dims, (ir.Shard(0),)) if split else None
    if probe == owner and kind == "expert_parallel":
        # the experts split on dim 0; anything else of the module stays a plain tensor
        return (
            Placed(mesh.mesh, mesh.dims, (ir.Shard(0),)) if name in expert_tensors(resolution.modules[owner]) else None
        )
    if probe == owner and kind in SHARDING_STYLES:
        # what the style does not shard, distribute_module replicates (an embedding's scale buffer)
        placement = tp_placement(style, resolution.modules[owner], name) or ir.Replicate()
        return Placed(mesh.mesh, mesh.dims, (placement,))
    if kind in REPLICATING_STYLES and is_param or kind == "distribute":
        return Placed(mesh.mesh, mesh.dims, (ir.Replicate(),))
    return None


def _fsdp(
    plan: ir.Plan, dp: ir.MeshRef, tp: Placed, mesh_sizes: Mapping[str, tuple[int, ...]], strided_shard: bool
) -> Placed:
    """FSDP2 over `tp`: dp shard dim -> Shard(0) (or _StridedShard when a later TP dim also shards dim 0;
    Shard(1) for a weight packed_colwise splits part by part, as runtime.tpstyles.fsdp_shard_placement
    has FSDP do), HSDP's replicate dim -> Replicate, TP dims unchanged; dims in the mesh's own order."""
    if dp.flat:  # world[dp*ep]: one dim, named as DeviceMesh._flatten names it
        if tp.mesh is not None:
            return unknown(f"fully_shard on the flattened {dp} over a tensor a parallelize rule placed")
        return Placed(dp.mesh, (dp.flat_name,), (ir.Shard(0),))
    mesh = plan.mesh(dp.mesh)
    sizes = dict(zip(mesh.dim_names, mesh_sizes[dp.mesh]))
    tp_dims = dict(zip(tp.dims, tp.placements)) if tp.mesh == dp.mesh else {}
    replicate_dims = dp.dims[:-1]  # HSDP: [replicate, shard]
    dims = tuple(d for d in mesh.dim_names if d in dp.dims or d in tp_dims)
    if tp.mesh is not None and tp.mesh != dp.mesh:
        return unknown(f"tensor parallel on mesh '{tp.mesh}' and fully_shard on mesh '{dp.mesh}'")
    if any(not isinstance(p, (ir.Shard, ir.StridedShard, ir.Replicate)) for p in tp_dims.values()):
        return unknown(f"fully_shard over {', '.join(map(placement_text, tp.placements))} a `use` style left")
    # packed_colwise's weight, strided on dim 0 (expert_tensor_parallel's are strided on dim 1: FSDP's Shard(0))
    packed = any(isinstance(p, ir.StridedShard) and p.dim == 0 for p in tp_dims.values())
    if packed and not packs_for_fsdp(plan):
        return unknown("fully_shard over the _StridedShard a `use` style left, without packed_colwise's placement fn")
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
    note = f"{tp.note}, then fully_shard's own" if tp.note else ""
    return Placed(dp.mesh, dims, tuple(placements), note=note)


def _shards_dim0(placement) -> bool:
    return isinstance(placement, (ir.Shard, ir.StridedShard)) and placement.dim == 0
