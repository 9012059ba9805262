"""What a checked plan means beyond what it spells out: expert parallelism that borrows data-parallel ranks.

`fully_shard on world[dp*ep] { each layers.* }` beside `parallelize layers.* on world.ep { mlp.experts :
expert_parallel }` (torchtitan's layout) shards every non-expert parameter over dp*ep, while the experts,
already split over ep, can only shard over what is left (dp): FSDP2 cannot shard a tensor over a dim it
is already split on. So each such experts module gets its own unit, as torchtitan gives it one on its
`efsdp` mesh: `fully_shard on world.dp { each layers.*.mlp.experts }`, with the same options, and with
gradients divided by the size of dp*ep instead of dp (the experts' gradients arrive summed over the ep
ranks' tokens by the all-to-all's backward; the other parameters' are averaged over all dp*ep ranks). And
the ep ranks train on different data: the style routes each rank's own tokens (`shared_batch=False`).
"""

from __future__ import annotations

import attrs

from . import ir
from . import syntax as s
from .diagnostics import SL102, Diagnostic


def borrowed_dims(plan: ir.Plan) -> dict[str, set[str]]:
    """By mesh, the dims an `expert_parallel` rule splits that a flattened fully_shard or replicate mesh
    also names: the ep dims whose ranks train on different data."""
    flat = {}
    for block in plan.units:
        if block.mesh.flat:
            flat.setdefault(block.mesh.mesh, set()).update(block.mesh.dims)
    found: dict[str, set[str]] = {}
    for block in plan.parallelize:
        dim = block.mesh.dims[0] if block.mesh.dims else None
        if dim in flat.get(block.mesh.mesh, ()) and any(r.style.builtin == "expert_parallel" for r in block.rules):
            found.setdefault(block.mesh.mesh, set()).add(dim)
    return found


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
    for block in plan.units:
        if block.kind == "fully_shard" and block.mesh.flat:
            units += _experts_blocks(plan, block, borrowed.get(block.mesh.mesh, set()), found)
        units.append(block)
    return attrs.evolve(plan, parallelize=tuple(parallelize), units=tuple(units)), found


def _own_tokens(rule: ir.Rule) -> ir.Rule:
    style = attrs.evolve(rule.style, kwargs=(*rule.style.kwargs, ("shared_batch", False)))
    return attrs.evolve(rule, style=style)


def _experts_blocks(plan: ir.Plan, block: ir.Units, ep_dims: set[str], found: list) -> list[ir.Units]:
    made = []
    for parallel in plan.parallelize:
        dim = parallel.mesh.dims[0] if parallel.mesh.dims else None
        if parallel.mesh.mesh != block.mesh.mesh or dim not in ep_dims or dim not in block.mesh.dims:
            continue
        rest = tuple(d for d in block.mesh.dims if d != dim)
        mesh = ir.MeshRef(block.mesh.mesh, rest, block.mesh.span, flat=len(rest) > 1)
        experts = [r for r in parallel.rules if r.style.builtin == "expert_parallel"]
        targets = [_joined(parallel.scope, r.target) for r in experts]
        for rule, target in zip(experts, targets):
            if target is None:
                found.append(
                    Diagnostic(
                        SL102,
                        f"the experts of `{rule.target}` need their own fully_shard unit over {mesh}, which "
                        "a `class` scope cannot name",
                        rule.span,
                        help=(f"scope the parallelize block with a pattern, or fully_shard them over {mesh} yourself",),
                    )
                )
        units = tuple(ir.Unit(t, block.options, t.span) for t in targets if t is not None)
        if units:
            made.append(ir.Units("fully_shard", mesh, units, block.options, False, block.span, divide_by=block.mesh))
    return made


def _joined(scope, target):
    """A rule's target as a pattern from the model's root (None for one under a `class` scope)."""
    if scope is None:
        return target
    if not isinstance(scope, s.Pattern) or not isinstance(target, s.Pattern):
        return None
    return s.Pattern(scope.segments + target.segments, target.span)
