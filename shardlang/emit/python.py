"""`compile --emit python`: a plan lowered for a model and world size, printed as plain torch code."""

from __future__ import annotations

import torch.nn as nn

from ..compiler.lint import lint
from ..compiler.lower import lower
from ..compiler.program import Program, to_python
from ..frontend import ir
from ..frontend.diagnostics import PlanError


def compile_program(plan: ir.Plan, model: nn.Module, world_size: int) -> Program:
    """Lint and lower; PlanError if the plan does not fit the model."""
    linted = lint(plan, model, world_size)
    if not linted.ok:
        raise PlanError(linted.diagnostics, {plan.source.name: plan.source})
    return lower(plan, linted.resolution, world_size)


def compile_python(plan: ir.Plan, model: nn.Module | None, world_size: int | None, command: str = "") -> str:
    """The program as Python: for `model` at `world_size` (default: what the meshes fix), or, without a
    model, for any model, matching the plan's targets when it runs."""
    if model is None:
        if world_size is not None:
            problems = plan.with_world(world_size)
            if problems:
                raise PlanError(problems, {plan.source.name: plan.source})
        return to_python(lower(plan, None, world_size), command)
    world_size = world_size or default_world_size(plan)
    return to_python(compile_program(plan, model, world_size), command)


def default_world_size(plan: ir.Plan) -> int:
    """The world a plan's meshes fix when none of their dims is `auto`; ValueError otherwise."""
    sizes = set()
    for mesh in plan.meshes:
        if any(d.size is None for d in mesh.dims):
            raise ValueError(f"mesh '{mesh.name}' has an auto dim: give the world size")
        n = 1
        for d in mesh.dims:
            n *= d.size
        sizes.add(n)
    if len(sizes) != 1:
        raise ValueError("give the world size")
    return sizes.pop()
