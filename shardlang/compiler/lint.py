"""Model-aware checks: the plan against a real module tree at a given world size (SL200 from resolving it,
the rest from the rules in compiler/rules, each a `Rule`; the codes are in docs/diagnostics.md).

Needs no process group and no GPU: the model may be built on the meta device, and mesh sizes come
from the plan and the world size, so `--world 1024` lints in one CPU process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch.nn as nn
from attrs import frozen

from ..frontend import ir
from ..frontend.diagnostics import SL301, Diagnostic
from ..frontend.static_checks import check_world
from .predict import Observed, Placed, mesh_shapes, predict
from .resolve import Resolution, resolve
from .rules import RULES, Rule
from .rules.common import pipeline_size
from .trace import Order


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
    observed: Mapping[str, Observed] | None = None,
    strided_shard: bool = True,
    runs: bool = True,
    order: Order | None = None,
    rules: Sequence[Rule] = RULES,
) -> Linted:
    """Resolve `plan` on `model`, predict placements at `world_size` and run every SL2xx check.
    `observed` and `strided_shard` are what apply knows of the `use` styles (run in a simulated world)
    and of the installed torch (see predict); without `observed`, what `use` styles place is not predicted.
    `runs` False leaves out SL301 (what the installed torch cannot run): explain lays out a plan in a
    simulated world without running it, and says in a note when its step fails. `order` is the order the
    model's modules run in (compiler.trace: `trace_order(model, example_input)`); without it the rules
    that follow activations (SL210) take declaration order and say so. `rules`: the rules to run (each a
    `Rule`), by default every one of compiler.rules.RULES; pass a subset, or add your own."""
    found = list(check_world(plan, world_size))
    if found:
        return Linted(None, None, tuple(found))
    shapes = mesh_shapes(plan, world_size)
    resolution, found = resolve(plan, model, pipeline_size(plan, shapes), order)
    if order is not None:
        resolution = attrs.evolve(resolution, order=order)
    predictions = predict(plan, resolution, shapes, observed, strided_shard)
    for rule in rules:
        found += rule(plan, resolution, predictions, shapes)
    if not runs:
        found = [d for d in found if d.code != SL301.name]
    return Linted(resolution, predictions, tuple(found))
