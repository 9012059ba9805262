"""`shardlang search`: the plan explain predicts fastest among those that fit (shardlang.search), linted with
the simulated step and applied with its checks on CPU workers before it is written."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ...frontend.source import Source
from ..inputs import load_model, meta_model, model_arg, order_always
from ..launcher import applied_on_cpu
from ..output import check_output, emit_diagnostics
from ..signals import time_limit
from ..status import OK, UNUSABLE, UsageError

#: The most local CPU workers a candidate is applied on; a larger world is only linted (with the step).
CPU_WORLD = 8
#: Bytes per parameter each CPU worker holds to check a plan: the unsharded reference's parameters,
#: gradients and Adam's two states in float32 (the sharded model's share is small beside it).
CHECK_BYTES = 16


def run_search(args: argparse.Namespace) -> int:
    """Weigh the candidates, print the table, check the best in order, write the first that passes with
    the runners-up in its header: exit 0; 2 when none fits (with the smallest peak found) or none passed."""
    from ...explain.timing import hardware, parse_size
    from ...search import Settings, search
    from ...search.ranking import HEADROOM, MEMORY

    check_output(args.output)
    model_file = load_model(args)
    if model_file is None:
        raise UsageError("search needs a model: MODEL (a file defining build_model), --entry or --hf PATH")
    if model_file.example_input is None:
        raise UsageError(
            f"search needs {model_file.origin} to define example_input(batch, generator): it predicts a step"
        )
    try:
        memory = parse_size(args.memory) if args.memory else int(MEMORY[args.gpu] * HEADROOM)
    except ValueError as e:
        raise UsageError(str(e)) from None
    model = meta_model(model_file)
    order = order_always(model, model_file)
    sequence = _sequence(model_file)
    tokens = args.tokens_per_step or 2 * args.world * sequence
    machine = hardware(args.gpu, gpus_per_node=args.gpus_per_node)
    settings = Settings(args.world, machine, memory, tokens, sequence, args.gpus_per_node, args.jobs)
    console = Console(file=sys.stderr, highlight=False, width=max(120, Console(file=sys.stderr).width))
    with Progress(
        TextColumn("search: explaining plans"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        bar = progress.add_task("", total=None)
        ranked = search(
            model_file,
            model,
            settings,
            model_arg(args).strip(),
            order,
            lambda finished, total: progress.update(bar, completed=finished, total=total),
        )
    console.print(_table(ranked, settings))
    fitting = [r for r in ranked if r.prediction.fits]
    if not fitting:
        peaks = [r.prediction.peak for r in ranked if r.prediction.peak is not None]
        smallest = f"; the smallest peak found: {_size(min(peaks))}" if peaks else ""
        print(f"shardlang search: no plan fits {_size(memory)} per GPU{smallest}", file=sys.stderr)
        return UNUSABLE
    if args.candidates:
        _write_candidates(Path(args.candidates), fitting, settings)
    for position, chosen in enumerate(fitting[: max(args.check, 1)]):
        said = (
            _checked(args, chosen.candidate.text, model, model_file, order) if args.check else "not checked (--check 0)"
        )
        if said is None:
            continue
        text = _written(chosen, fitting, position, said, settings)
        if args.output:
            Path(args.output).write_text(text, encoding="utf-8")
            print(f"wrote {args.output}: {chosen.candidate.name} ({said})")
        else:
            sys.stdout.write(text)
        return OK
    print(f"shardlang search: none of the best {args.check} passed lint and its checks on CPU", file=sys.stderr)
    return UNUSABLE


def _write_candidates(folder: Path, fitting, settings) -> None:
    """Every plan that fits, best first, each with its prediction in its header (to measure them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for number, ranked in enumerate(fitting, 1):
        said = f"candidate {number} of {len(fitting)}, not checked"
        text = _written(ranked, [], 0, said, settings)
        (folder / f"{number:02d}.sl").write_text(text, encoding="utf-8")


def _sequence(model_file) -> int:
    """The sequence length of the model file's example_input: its first tensor's dim 1."""
    import torch

    inputs = model_file.example_input(1, torch.Generator().manual_seed(0))
    first = next(t for t in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)) if isinstance(t, torch.Tensor))
    return int(first.shape[1]) if first.ndim > 1 else 1


def _checked(args, text: str, model, model_file, order) -> str | None:
    """lint with the simulated step, then (where the world and the host allow) apply with every check on
    CPU workers: what passed, or None (printing what failed)."""
    from ...explain.linting import read_and_linted

    source = Source(args.output or "<search>", text)
    try:
        with time_limit(args.timeout, "lint's simulated step"):
            plan, found = read_and_linted(source, model, model_file, args.world, order)
    except UsageError as e:
        print(f"search: {e}; the next one is checked", file=sys.stderr)
        return None
    if plan is None or any(d.is_error for d in found):
        emit_diagnostics(found, {source.name: source}, "text", stream=sys.stderr)
        print("search: lint found errors in this candidate; the next one is checked", file=sys.stderr)
        return None
    size = sum(p.numel() for p in model.parameters())
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.world > CPU_WORLD or args.world * size * CHECK_BYTES > host // 2:
        why = f"world {args.world}" if args.world > CPU_WORLD else f"{size / 1e9:.2f}B parameters"
        return f"linted clean with the step at world {args.world}; not applied on CPU ({why}): apply it on the GPUs"
    report = applied_on_cpu(args, plan, source, model_file, args.world, order)
    if report is None:
        return None
    if report.ok and report.usable:
        return f"linted clean and applied at world {args.world} on CPU: {report.summary or 'every check passed'}"
    from ...launch.report import render

    render(report, {source.name: source}, Console(file=sys.stderr, highlight=False, soft_wrap=True))
    print("search: this candidate failed its checks on CPU; the next one is checked", file=sys.stderr)
    return None


def _table(ranked, settings) -> Table:
    table = Table(
        title=f"{len(ranked)} plans at world {settings.world}, {settings.tokens:,} tokens per step, "
        f"{_size(settings.memory)} per GPU"
    )
    for column in ("#", "plan", "peak", "step", "tokens/s", "micro-batch x acc", "why not"):
        table.add_column(column, justify="right" if column in ("#", "peak", "step", "tokens/s") else "left")
    for number, r in enumerate(ranked, 1):
        p = r.prediction
        table.add_row(
            str(number),
            r.candidate.name,
            _size(p.peak),
            f"{p.seconds * 1e3:.1f} ms" if p.seconds else "-",
            f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-",
            f"{p.micro_batch} x {p.accumulation}" if p.fits else "-",
            "" if p.fits else (p.why or ""),
        )
    return table


def _written(chosen, fitting, position: int, said: str, settings) -> str:
    """The plan as search writes it: its header (`_header`), then the candidate without init's first line."""
    body = chosen.candidate.text.splitlines(keepends=True)
    body = body[1:] if body and body[0].startswith("# Starter plan") else body
    return _header(chosen, fitting, position, said, settings) + "".join(body)


def _header(chosen, fitting, position: int, said: str, settings) -> str:
    """The comment the written plan starts with: what was chosen and predicted, how it was checked, and the
    runners-up with their predicted peak and step time."""
    p = chosen.prediction
    lines = [
        f"# Written by `shardlang search` at world {settings.world} on {settings.machine.gpu}, "
        f"{settings.tokens:,} tokens per step:",
        f"#   {chosen.candidate.name}: predicted peak {_size(p.peak)} per GPU, step {p.seconds * 1e3:.1f} ms, "
        f"{p.tokens_per_s:,.0f} tokens/s, micro-batch {p.micro_batch} x {p.accumulation} accumulation step(s).",
        f"#   {said}.",
    ]
    if position:
        lines.append(f"#   The {position} plan(s) predicted faster failed lint or their checks on CPU.")
    lines.append("# Runners-up (explain's prediction):")
    for r in [r for r in fitting if r is not chosen][:5]:
        q = r.prediction
        lines.append(
            f"#   {r.candidate.name}: peak {_size(q.peak)}, step {q.seconds * 1e3:.1f} ms, {q.tokens_per_s:,.0f} tokens/s"
        )
    return "\n".join(lines) + "\n"


def _size(bytes_: int | None) -> str:
    from ...explain.pictures import size

    return "-" if bytes_ is None else size(bytes_)
