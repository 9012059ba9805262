"""`shardlang lint`: the plan's static checks; with a model, the checks against it and a simulated step."""

from __future__ import annotations

import argparse
import sys

from ...frontend.diagnostics import PlanError, sort_key
from ...frontend.ir import Plan
from ..inputs import compile_plan, load_model, meta_model, order_for, plan_world
from ..output import emit_diagnostics
from ..status import FOUND, OK, UNUSABLE


def run_lint(args: argparse.Namespace) -> int:
    """Static checks; with a model, SL2xx too. SL1xx errors: exit 2 (no plan); SL2xx errors: exit 1."""
    plan, found, sources = compile_plan(args.plan, args.params, args.world)
    model_file = load_model(args)
    note = ""
    if plan is not None and model_file is not None:
        model = meta_model(model_file)
        world = plan_world(plan, args.world)
        linted, note = lint_against(
            plan, model, model_file, world, order_for(plan, model, model_file), not args.no_step
        )
        found = sorted([*found, *linted], key=sort_key)
    emit_diagnostics(found, sources, args.format)
    if plan is None:
        return UNUSABLE
    if args.format == "text" and not found:
        print(f"{args.plan}: no problems found" + (f" ({note})" if note else ""))
    elif args.format == "text" and note:
        print(f"lint: {note}", file=sys.stderr)
    return FOUND if any(d.is_error for d in found) else OK


def lint_against(plan: Plan, model, model_file, world: int, order, step: bool = True) -> tuple[list, str]:
    """lint of `plan` against `model` (on meta) at `world`: the rules, then (with `step`, when they found no
    error) the simulated training step; its diagnostics, and the step's note. `lint` and `init` run it."""
    linted = _lint_model(plan, model, world, order)
    found = list(linted.diagnostics)
    if not (linted.ok and step):
        return found, ""
    from ...explain.rehearsal import rehearse

    rehearsal = rehearse(plan, model, model_file, world, linted.resolution)
    if rehearsal.ran:  # what SL210 guesses from the plan, the step saw (SL222)
        found = [d for d in found if d.code != "SL210"]
    return [*found, *rehearsal.diagnostics], rehearsal.note


def _lint_model(plan: Plan, model, world: int, order):
    """lint against the model, running its `use` styles in a simulated world to see what they place (only a
    plan with `use` styles imports the runtime for it)."""
    from ...compiler.lint import lint

    if not plan.uses:
        return lint(plan, model, world, order=order)
    from ...compiler.lint import Linted
    from ...runtime.apply import import_uses, lint_seeing_styles

    try:
        imported = import_uses(plan)
    except PlanError as e:
        return Linted(None, None, tuple(e.diagnostics))
    return lint_seeing_styles(plan, model, world, imported, order=order)
