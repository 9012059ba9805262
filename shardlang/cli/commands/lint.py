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
        linted = _lint_model(plan, model, world, order_for(plan, model, model_file))
        found = sorted([*found, *linted.diagnostics], key=sort_key)
        if linted.ok and not args.no_step:
            from ...explain.rehearsal import rehearse

            rehearsal = rehearse(plan, model, model_file, world, linted.resolution)
            if rehearsal.ran:  # what SL210 guesses from the plan, the step saw (SL222)
                found = [d for d in found if d.code != "SL210"]
            found, note = sorted([*found, *rehearsal.diagnostics], key=sort_key), rehearsal.note
    emit_diagnostics(found, sources, args.format)
    if plan is None:
        return UNUSABLE
    if args.format == "text" and not found:
        print(f"{args.plan}: no problems found" + (f" ({note})" if note else ""))
    elif args.format == "text" and note:
        print(f"lint: {note}", file=sys.stderr)
    return FOUND if any(d.is_error for d in found) else OK


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
