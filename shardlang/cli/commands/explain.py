"""`shardlang explain`: what every rank will hold and send, at any world size, in one CPU process."""

from __future__ import annotations

import argparse
import io
import json
import sys

from rich.console import Console
from rich.table import Table

from ...frontend.diagnostics import PlanError, sort_key
from ..inputs import compile_plan, load_model, meta_model, plan_world
from ..output import check_output, emit_diagnostics, explanation_data, write_output
from ..signals import time_limit
from ..status import OK, UNUSABLE, UsageError


def run_explain(args: argparse.Namespace) -> int:
    """Per-parameter layouts, per-rank memory, one step's collectives, peak memory and time at `--world N`
    (or the world the plan's meshes fix; docs/language.md §8); `--compare` a second plan, `--fit` the largest batch."""
    from ...explain.pictures import render_compare, render_svg, render_text
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
                explanations.append(
                    explain(
                        plan,
                        meta_model(model_file),
                        world,
                        args.rank,
                        model_file,
                        blocks_for=args.param,
                        step=args.step,
                        full_step=args.full_step,
                        batch=args.batch,
                        hardware=machine,
                        fit=fit,
                    )
                )
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


def render_held_compare(a, b, console: Console) -> None:
    """Two plans side by side without a simulated step, which has the peak, the bytes sent and the step time:
    what rank R and the largest rank hold for training (the memory-per-rank table's columns)."""
    from ...explain.pictures import size

    console.print(
        f"\n[bold]{a.plan}[/bold] against [bold]{b.plan}[/bold] at world {a.world_size}, rank {a.rank}: what each"
        " rank holds (peak memory, bytes sent and step time need the training step: drop --no-step)"
    )
    table = Table(header_style="bold")
    for column, justify in (("", "left"), (a.plan, "right"), (b.plan, "right"), ("difference", "right")):
        table.add_column(column, justify=justify)

    def row(label: str, x: int, y: int) -> None:
        table.add_row(label, size(x), size(y), ("+" if y >= x else "-") + size(abs(y - x)))

    mine, theirs = a.this_rank, b.this_rank
    for label, field in (
        ("parameters", "params"),
        ("gradients", "grads"),
        ("optimizer states", "optimizer"),
        ("gathered (largest unit)", "gathered"),
    ):
        row(f"rank {a.rank}: {label}", getattr(mine, field), getattr(theirs, field))
    row(f"rank {a.rank}: total", mine.total, theirs.total)
    row("largest rank's total", a.largest.total, b.largest.total)
    console.print(table)
