"""`shardlang lint`: the plan's static checks; with a model, the checks against it and a simulated step."""

from __future__ import annotations

import argparse
import sys

from ...explain.linting import lint_against
from ...frontend.diagnostics import sort_key
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
