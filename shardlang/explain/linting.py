"""lint against a model, then the simulated training step (explain.rehearsal): what `lint`, `init` and
`search` run on a plan and a model file."""

from __future__ import annotations

from ..frontend.diagnostics import PlanError
from ..frontend.ir import Plan


def lint_against(plan: Plan, model, model_file, world: int, order, step: bool = True) -> tuple[list, str]:
    """lint of `plan` against `model` (on meta) at `world`: the rules, then (with `step`, when they found no
    error) the simulated training step; its diagnostics, and the step's note."""
    linted = lint_model(plan, model, world, order)
    found = list(linted.diagnostics)
    if not (linted.ok and step):
        return found, ""
    from .rehearsal import rehearse

    rehearsal = rehearse(plan, model, model_file, world, linted.resolution)
    if rehearsal.ran:  # what SL210 guesses from the plan, the step saw (SL222)
        found = [d for d in found if d.code != "SL210"]
    return [*found, *rehearsal.diagnostics], rehearsal.note


def read_and_linted(source, model, model_file, world: int, order) -> tuple[Plan | None, list]:
    """The plan `source` holds, read at `world` (None where it does not compile), and every diagnostic:
    the reading's, then lint's with the simulated step (`lint_against`), in source order."""
    from ..frontend.diagnostics import sort_key
    from ..frontend.read import read_source

    plan, found = read_source(source, None, world)
    if plan is None:
        return None, found
    linted, _ = lint_against(plan, model, model_file, world, order, True)
    return plan, sorted([*found, *linted], key=sort_key)


def lint_model(plan: Plan, model, world: int, order):
    """lint against the model, running its `use` styles in a simulated world to see what they place (only a
    plan with `use` styles imports the runtime for it)."""
    from ..compiler.lint import lint

    if not plan.uses:
        return lint(plan, model, world, order=order)
    from ..compiler.lint import Linted
    from ..runtime.apply import import_uses, lint_seeing_styles

    try:
        imported = import_uses(plan)
    except PlanError as e:
        return Linted(None, None, tuple(e.diagnostics))
    return lint_seeing_styles(plan, model, world, imported, order=order)
