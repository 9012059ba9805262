"""What a checked plan means beyond what it spells out: expert parallelism that borrows data-parallel ranks.

`fully_shard on world[dp*ep] { each layers.* }` beside `parallelize layers.* on world.ep { mlp.experts :
expert_parallel }` (torchtitan's layout) shards every non-expert parameter over dp*ep, while the experts,
already split over ep, can only shard over what is left (dp): FSDP2 cannot shard a tensor over a dim it
is already split on. So each such experts module gets its own unit, as torchtitan gives it one on its
`efsdp` mesh: `fully_shard on world.dp { each layers.*.mlp.experts }`, with the same options, and with
gradients divided by the size of dp*ep instead of dp (the experts' gradients arrive summed over the ep
ranks' tokens by the all-to-all's backward; the other parameters' are averaged over all dp*ep ranks). And
the ep ranks train on different data: the style routes each rank's own tokens (`shared_batch=False`).

`fully_shard on world.ep` beside the same rule, with ep the only data dim (torchtitan's `dp_shard = ep`),
means what `world[dp*ep]` means with dp of size 1 (SPEC §12): nothing is left of the block's dims for the
experts, so the mesh gets a dim of size 1 (`dp`, or a free name), outermost, as torchtitan's `efsdp` of
size 1, and the experts' unit is over it with gradients divided by ep.
"""

from __future__ import annotations

import attrs

from . import ir
from . import syntax as s
from .diagnostics import SL102, Diagnostic


def borrowed_dims(plan: ir.Plan) -> dict[str, set[str]]:
    """By mesh, the dims an `expert_parallel` rule splits that a fully_shard block also names, over a
    flattened mesh (`world[dp*ep]`) or over that dim alone (`world.ep`, ep the only data dim): the ep dims
    whose ranks train on different data. (A replicate block cannot borrow them: SL218.)"""
    data = {}
    for block in plan.units:
        if _borrows(block, set(block.mesh.dims)):
            data.setdefault(block.mesh.mesh, set()).update(block.mesh.dims)
    found: dict[str, set[str]] = {}
    for block in plan.parallelize:
        dim = block.mesh.dims[0] if block.mesh.dims else None
        if dim in data.get(block.mesh.mesh, ()) and any(r.style.builtin == "expert_parallel" for r in block.rules):
            found.setdefault(block.mesh.mesh, set()).add(dim)
    return found


def _borrows(block: ir.Units, ep_dims: set[str]) -> bool:
    """Whether a data-parallel block's mesh takes an ep dim's ranks: flattened with it, or a fully_shard
    block over it alone."""
    if block.kind != "fully_shard" or not set(block.mesh.dims) & ep_dims:
        return False
    return block.mesh.flat or len(block.mesh.dims) == 1


def expert_units(plan: ir.Plan) -> tuple[ir.Plan, list[Diagnostic]]:
    """The plan with an experts unit before each flattened fully_shard block whose dims include an
    `expert_parallel` dim, and those rules' experts routing their own tokens (see the module's docstring);
    SL102 for such a rule under a `class` scope, whose experts no pattern can name."""
    borrowed = borrowed_dims(plan)
    if not borrowed:
        return plan, []
    found = []
    parallelize = []
    for block in plan.parallelize:
        if block.mesh.dims and block.mesh.dims[0] in borrowed.get(block.mesh.mesh, ()):
            rules = tuple(_own_tokens(r) if r.style.builtin == "expert_parallel" else r for r in block.rules)
            block = attrs.evolve(block, rules=rules)
        parallelize.append(block)
    units = []
    meshes = {m.name: m for m in plan.meshes}
    borrowing = [b for b in plan.units if _borrows(b, borrowed.get(b.mesh.mesh, set()))]
    for block in plan.units:
        if any(b is block for b in borrowing):
            units += _experts_blocks(plan, block, borrowing, borrowed[block.mesh.mesh], meshes, found)
        units.append(block)
    plan = attrs.evolve(plan, meshes=tuple(meshes.values()))
    return attrs.evolve(plan, parallelize=tuple(parallelize), units=tuple(units)), found


def _own_tokens(rule: ir.Rule) -> ir.Rule:
    style = attrs.evolve(rule.style, kwargs=(*rule.style.kwargs, ("shared_batch", False)))
    return attrs.evolve(rule, style=style)


def _experts_blocks(
    plan: ir.Plan, block: ir.Units, borrowing: list[ir.Units], ep_dims: set[str], meshes: dict, found: list
) -> list[ir.Units]:
    """The experts' units that one data-parallel block borrowing the ep dims owns (of all the `borrowing`
    blocks, each experts target gets one unit: _owner); `meshes` (by name) gets a dim of size 1 where
    nothing is left of the block's dims for the experts."""
    made = []
    for parallel in plan.parallelize:
        dim = parallel.mesh.dims[0] if parallel.mesh.dims else None
        if parallel.mesh.mesh != block.mesh.mesh or dim not in ep_dims or dim not in block.mesh.dims:
            continue
        candidates = [b for b in borrowing if b.mesh.mesh == block.mesh.mesh and dim in b.mesh.dims]
        rest = tuple(d for d in block.mesh.dims if d != dim) or (_one_rank_dim(meshes, block.mesh.mesh),)
        mesh = ir.MeshRef(block.mesh.mesh, rest, block.mesh.span, flat=len(rest) > 1)
        experts = [r for r in parallel.rules if r.style.builtin == "expert_parallel"]
        targets = [_joined(parallel.scope, r.target) for r in experts]
        for rule, target in zip(experts, targets):
            if target is None and candidates[0] is block:
                found.append(
                    Diagnostic(
                        SL102,
                        f"the experts of `{rule.target}` need their own fully_shard unit over {mesh}, which "
                        "a `class` scope cannot name",
                        rule.span,
                        help=(f"scope the parallelize block with a pattern, or fully_shard them over {mesh} yourself",),
                    )
                )
        mine = [t for t in targets if t is not None and _owner(candidates, t) is block]
        units = tuple(ir.Unit(t, block.options, t.span) for t in mine)
        if units:
            made.append(ir.Units("fully_shard", mesh, units, block.options, False, block.span, divide_by=block.mesh))
    return made


def _owner(blocks: list[ir.Units], target) -> ir.Units:
    """Of the blocks that borrow an ep dim, the one whose options the experts' unit of `target` takes: the
    first with a unit over a module above the experts (a pattern whose segments start theirs, `*` standing
    for any), else the first with a root unit, else the first. (A unit of the experts for each block would
    make them a unit twice, SL201.)"""

    def above(unit: ir.Unit) -> bool:
        if not isinstance(unit.target, s.Pattern) or not isinstance(target, s.Pattern):
            return False  # (a `class` target: no pattern to compare)
        head = unit.target.segments
        if len(head) > len(target.segments):
            return False
        return all(a == b or a == "*" for a, b in zip(head, target.segments))

    return next((b for b in blocks if any(above(u) for u in b.units)), next((b for b in blocks if b.root), blocks[0]))


def _one_rank_dim(meshes: dict, name: str) -> str:
    """The name of a dim of size 1 of mesh `name` for the experts' unit where ep is the only data dim (as
    torchtitan's `efsdp` of size 1): its own `dp` of size 1, else one added outermost (`dp`, or a free
    name), once a mesh."""
    mesh = meshes[name]
    ones = [d.name for d in mesh.dims if d.size == 1 and d.name in _ONE_RANK_NAMES]
    if ones:
        return ones[0]
    free = next(n for n in _ONE_RANK_NAMES if n not in mesh.dim_names)
    meshes[name] = attrs.evolve(mesh, dims=(ir.MeshDim(free, 1, mesh.span), *mesh.dims))
    return free


_ONE_RANK_NAMES = ("dp", "efsdp", "dp_experts")


def _joined(scope, target):
    """A rule's target as a pattern from the model's root (None for one under a `class` scope)."""
    if scope is None:
        return target
    if not isinstance(scope, s.Pattern) or not isinstance(target, s.Pattern):
        return None
    return s.Pattern(scope.segments + target.segments, target.span)
