"""`shardlang compile`: the plan as plain torch code."""

from __future__ import annotations

import argparse
import sys

from ...frontend.diagnostics import PlanError, sort_key
from ..inputs import compile_plan, load_model, meta_model, model_arg, plan_world
from ..output import check_output, emit_diagnostics, write_output
from ..status import OK, UNUSABLE


def run_compile(args: argparse.Namespace) -> int:
    """The program as Python on stdout (or -o); diagnostics on stderr. A plan that does not compile: 2."""
    from ...emit.python import compile_python

    check_output(args.output)
    plan, found, sources = compile_plan(args.plan, args.params, args.world)
    model_file = load_model(args)
    code = None
    if plan is not None:
        model = meta_model(model_file) if model_file is not None else None
        named = model_arg(args)
        world_arg = f" --world {args.world}" if args.world else ""
        command = f"shardlang compile {args.plan}{named}{world_arg} --emit python"
        try:
            code = compile_python(
                plan, model, plan_world(plan, args.world) if model is not None else args.world, command
            )
        except PlanError as e:
            found = sorted([*found, *e.diagnostics], key=sort_key)
    emit_diagnostics(found, sources, "text", stream=sys.stderr)
    if code is None:
        return UNUSABLE
    if args.output:
        write_output(args.output, code)
    else:
        sys.stdout.write(code)
    return OK
