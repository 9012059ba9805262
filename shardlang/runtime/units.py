"""fully_shard and replicate units: the order they are wrapped in (children first), what fully_shard takes
for a module, and a unit whose gradients are divided by other than its mesh's size. Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations

from ..frontend.patterns import depth, modules_matching, named_units_win


def wrap_children_first(model, units):
    """Apply each (target, kind, wrap) to the modules its target matches, deepest modules first, so that
    a fully_shard or replicate unit is always wrapped before any unit that contains it. A tuple of targets
    is one unit over every module they match (`unit a, b`): `wrap` gets the list, when it is wrapped
    after the units inside its shallowest module."""
    order = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    matches = []
    for target, kind, wrap in units:
        if isinstance(target, tuple):
            fqns = tuple(sorted({fqn for t in target for fqn in modules_matching(model, t)}, key=order.__getitem__))
            matches += [(fqns, kind, False, wrap)] if fqns else []
        else:
            matches += [(fqn, kind, target.startswith("class "), wrap) for fqn in modules_matching(model, target)]

    def children_first(match):
        fqns = match[0] if isinstance(match[0], tuple) else (match[0],)
        return -min(map(depth, fqns)), order[fqns[0]]

    for fqns, _, _, wrap in sorted(named_units_win(matches), key=children_first):
        if isinstance(fqns, tuple):
            wrap([model.get_submodule(fqn) for fqn in fqns])
        else:
            wrap(model.get_submodule(fqns))


def unit_of(module):
    """What fully_shard takes for `module`: the module itself, or, for a ModuleList or ModuleDict with a
    forward of its own (experts held as modules, after expert_parallel), the list of its members: one unit
    over them all. torch 2.11's fully_shard refuses any container, forward or not; later torches take it."""
    import torch.nn as nn

    container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
    if container and ("forward" in vars(module) or type(module).forward is not nn.Module.forward):
        return list(module.children())
    return module


def divide_gradients(unit, factor: int, mesh) -> None:
    """An FSDP unit over `mesh` whose gradients are reduced as a sum divided by `factor` instead of the mesh's
    size (experts that borrow data-parallel ranks: frontend.desugar). gloo has no PreMulSum: there the sum
    is reduced and divided after. A unit over one rank reduces nothing, and FSDP2 divides its copy of the
    gradient by the factor and then again by the post-division that a summed (or fp16) reduction sets, so
    there the unit keeps FSDP's own (no) division and a hook after its reduction divides once (dp of size
    1: every data rank is an ep rank). `unit`: what fully_shard returned (a list of modules for a unit over
    several, which share one state: any of them sets it)."""
    import torch.distributed as dist

    unit = unit[0] if isinstance(unit, list) else unit
    if mesh.size() == 1:
        unit.set_all_reduce_hook(lambda reduced: reduced.div_(float(factor)))
        return
    unit.set_gradient_divide_factor(float(factor))
    if dist.get_backend(mesh.get_group()) == "gloo":
        unit.set_force_sum_reduction_for_comms(True)
