"""`shardlang explain`: what every rank will hold and send, at any world size, in one CPU process."""

from __future__ import annotations

import argparse
import io
import json
import sys

from rich.console import Console

from ...frontend.diagnostics import PlanError, sort_key
from ..inputs import compile_plan, load_model, meta_model, plan_world
from ..output import check_output, emit_diagnostics, explanation_data, write_output
from ..signals import time_limit
from ..status import OK, UNUSABLE, UsageError


def run_explain(args: argparse.Namespace) -> int:
    """Per-parameter layouts, per-rank memory, one step's collectives, peak memory and time at `--world N`
    (or the world the plan's meshes fix; docs/commands.md); `--compare` a second plan, `--fit` the largest batch."""
    from ...explain.options import ExplainOptions
    from ...explain.pictures import render_compare, render_held_compare, render_svg, render_text
    from ...explain.simulate import explain
    from ...explain.timing import hardware, parse_number, parse_size

    check_output(args.output)
    model_file = load_model(args)
    if model_file is None:
        raise UsageError(
            "explain needs a model: MODEL (a file defining build_model), --entry package.module:function or --hf PATH"
        )
    try:
        machine = hardware(
            args.gpu,
            parse_number(args.flops, "FLOP/s") if args.flops else None,
            parse_number(args.hbm) if args.hbm else None,
            args.link,
            args.gpus_per_node,
        )
        fit = parse_size(args.fit) if args.fit else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    explanations, world = [], args.world
    for path in (args.plan, args.compare) if args.compare else (args.plan,):
        plan, found, sources = compile_plan(path, args.params, world)
        if plan is None:
            emit_diagnostics(found, sources, "text", stream=sys.stderr)
            return UNUSABLE
        if world is None:  # the world the first plan's meshes fix, which --compare's plan is explained at too
            world = plan_world(plan, None)
        if not 0 <= args.rank < world:
            raise UsageError(f"--rank {args.rank} is not in a world of {world}")
        try:
            with time_limit(args.timeout, "explain (building the model and simulating the step)"):
                options = ExplainOptions(
                    world, args.rank, args.param, args.step, args.full_step, args.batch, machine, fit
                )
                explanations.append(explain(plan, meta_model(model_file), options, model_file))
        except PlanError as e:
            emit_diagnostics(sorted([*found, *e.diagnostics], key=sort_key), sources, "text", stream=sys.stderr)
            return UNUSABLE
        emit_diagnostics(found, sources, "text", stream=sys.stderr)
    explanation = explanations[0]
    if args.format == "svg":
        text = render_svg(explanation, args.param)
    elif args.format == "json":
        data = explanation_data(explanation, args.param)
        if args.compare:
            data = {"plans": [data, explanation_data(explanations[1], args.param)]}
        text = json.dumps(data, indent=2) + "\n"
    else:
        stream = io.StringIO()
        console = Console(file=stream if args.output else sys.stdout, highlight=False, soft_wrap=False, width=160)
        for one in explanations:
            render_text(one, console, args.param)
        if args.compare and any(e.peak is not None or e.collectives or e.time is not None for e in explanations):
            render_compare(*explanations, console)
        elif args.compare:  # no step (--no-step, or no example_input): what each rank holds is what compares
            render_held_compare(*explanations, console)
        text = stream.getvalue() if args.output else None
    if text is not None and args.output:
        write_output(args.output, text)
    elif text is not None:
        sys.stdout.write(text)
    return OK
