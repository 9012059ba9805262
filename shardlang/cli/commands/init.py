"""`shardlang init`: a starter plan for a model, linted and then applied with its checks on CPU workers."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from ...frontend.diagnostics import sort_key
from ...frontend.ir import Plan
from ...frontend.source import Source
from ..inputs import load_model, meta_model, model_arg, order_always
from ..launcher import applied_on_cpu
from ..output import check_output, emit_diagnostics
from ..status import FOUND, OK, UNUSABLE, UsageError

if TYPE_CHECKING:
    from ...runtime.modelfile import ModelFile


def run_init(args: argparse.Namespace) -> int:
    """A starter plan on stdout (or -o), linted against the model at tp x dp (dp 2 where it is auto), then
    applied there on CPU workers with all its checks (unless --no-check). The plan is written all the same,
    to edit; the last line (stderr when the plan goes to stdout) says what was found: exit 0 when it lints
    clean and passes its checks, 1 when lint found errors or a check failed, 2 when the checks could not
    run (a model file without example_input says so, and exits 0 after a clean lint)."""
    from ...compiler.dropping import Drops
    from ...compiler.starter import init_plan, root_initialiser
    from ...explain.unwritten import left_unwritten

    check_output(args.output)
    model_file = load_model(args)
    if model_file is None:
        raise UsageError(
            "init needs a model: MODEL (a file defining build_model), --entry package.module:function or --hf PATH"
        )
    model = meta_model(model_file)
    order = order_always(model, model_file)
    unwritten = left_unwritten(model, root_initialiser(model)) or ()

    def written(drops: Drops) -> str:
        return init_plan(
            model,
            tp=args.tp,
            dp=args.dp,
            ep=args.ep,
            cp=args.cp,
            pp=args.pp,
            name=model_arg(args).strip(),
            order=order,
            unwritten=unwritten,
            drops=drops,
        )

    drops = Drops()
    while True:  # lint, then apply's checks; an init mode whose init check alone fails gives way to the next
        text, source, plan, found, (world, stopped), drops = _lint_rounds(
            args, written, drops, model, model_file, order
        )
        at = f"world {world}, though the step stopped short ({stopped})" if stopped else f"world {world}"
        verdict = _verdict(args, text, source, plan, found, at, drops, model_file)
        if verdict is not None:
            return verdict
        status, failed_init, refused_pp = _check_init(args, plan, source, model_file, world, order)
        fewer = failed_init and drops.after_init(plan.init, failed_init)
        fewer = fewer or (refused_pp and drops.after_pipeline(refused_pp))
        if not fewer:
            return status
        drops = fewer


def _lint_rounds(args, written, drops, model, model_file: ModelFile, order):
    """The starter written and linted, leaving out one feature a round that an error points at (at most
    ROUNDS, compiler.dropping.settle): its text, source, plan, diagnostics, world (with where the simulated
    step stopped short, if it did), and what was left out."""
    from ...compiler.dropping import ROUNDS, settle

    name, worlds = args.output or "<init>", []

    def linted(text: str):
        plan, found, world, note = _linted(args, Source(name, text), model, model_file, order)
        worlds.append((world, note.partition("; the step stopped: ")[2]))
        return plan, found

    text, plan, found, drops = settle(written, linted, name, ROUNDS, drops)
    return text, Source(name, text), plan, found, worlds[-1], drops


def _verdict(args, text: str, source: Source, plan, found, world: str, drops, model_file: ModelFile) -> int | None:
    """Write the plan and say what lint found; the exit status, or None when the plan is to be applied."""
    for line in [*drops.said(), *_partners_left_out(text)]:
        print(f"init: {line}", file=sys.stdout if args.output else sys.stderr)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    emit_diagnostics(found, {source.name: source}, "text", stream=sys.stderr)
    linted = f"linted at {world}: {'clean' if not found else f'{len(found)} diagnostics'}"
    if plan is None or any(d.is_error for d in found):
        _said(args, f"{linted}; not applied: fix the errors first")
        return FOUND
    if not args.check:
        _said(args, f"{linted}; not applied (--no-check): run `shardlang apply` before training with it")
        return OK
    if model_file.example_input is None:
        _said(
            args,
            f"{linted}; not applied: {model_file.origin} defines no example_input(batch, generator), which the "
            "gradients check needs: add one, or run `shardlang apply --verify ...` yourself",
        )
        return OK
    return None


def _linted(args: argparse.Namespace, source: Source, model, model_file: ModelFile, order):
    """The starter `source` read and linted against the model, with the simulated step where the model file
    gives example_input: its plan (None when unreadable), every diagnostic, the world it was linted at, and
    the step's note."""
    from ...explain.linting import lint_against
    from ...frontend.read import read_source

    plan, found = read_source(source, None, None)
    if plan is None:
        return None, found, args.pp * args.tp * args.ep * args.cp * (args.dp or 2), ""
    world = plan.meshes[0].fixed_size * (1 if args.dp else 2)
    step = model_file.example_input is not None
    linted, note = lint_against(plan, model, model_file, world, order, step)
    return plan, sorted([*found, *linted], key=sort_key), world, note


#: A rule left out with its group (compiler.proposed.with_partners), as init_plan comments it.
PARTNER = re.compile(r"^ *# +(\S+) +: [^:\n]+: left out \(lint's simulated step: (it runs only with [^\n]*)\)$", re.M)


def _partners_left_out(text: str) -> list[str]:
    """The rules of the plan `text` left out because a rule of their group was, for init's output."""
    return [f"left out rule {key}: {why}" for key, why in PARTNER.findall(text)]


def _said(args: argparse.Namespace, what: str) -> None:
    """init's verdict: after `wrote PLAN` on stdout, or on stderr when the plan itself went to stdout."""
    if args.output:
        print(f"wrote {args.output} ({what})")
    else:
        print(f"shardlang init: {what}", file=sys.stderr)


def _check_init(
    args: argparse.Namespace, plan: Plan, source: Source, model_file: ModelFile, world: int, order
) -> tuple[int, str | None, str | None]:
    """Apply init's plan at `world` on CPU workers (gloo), as `apply --device cpu` does, with its checks: the
    exit status, the init check's message where it alone failed (another init mode may pass), and why the
    pipeline cannot run where apply refused it (lint's step stopped short of the blocks: Longformer)."""
    from ...runtime.pipeline import CONTRACT

    raised: list = []
    report = applied_on_cpu(args, plan, source, model_file, world, order, raised)
    said = list(raised)
    if report is not None:
        said += [c.message for c in report.checks if c.status == "fail"] + [d.message for d in report.diagnostics]
    refused = next((m[m.index(w) :] for m in said for w in CONTRACT if w in m), None)
    if refused is not None and plan.pipeline is not None:
        print("init: apply found that the pipeline cannot run; leaving it out", file=sys.stderr)
        return FOUND, None, refused.splitlines()[0]
    if report is None:
        _said(args, f"applied at world {world} on CPU: it did not run to the end; do not train with it as it is")
        return UNUSABLE, None, None
    counts = report.summary
    if report.ok and report.usable:
        _said(args, f"linted clean and applied at world {world} on CPU: {counts or 'every check passed'}")
        return OK, None, None
    failed = {c.check: c.message for c in report.checks if c.status == "fail"}
    if list(failed) == ["init"] and plan.init.mode == "meta":
        print(f"init: `{plan.init}` failed its init check; trying the next init mode", file=sys.stderr)
        return FOUND, failed["init"], None
    from ...launch.report import render

    render(report, {source.name: source}, Console(file=sys.stderr, highlight=False, soft_wrap=True))
    _said(args, f"applied at world {world} on CPU, its checks FAILED ({counts}): edit it before training with it")
    return FOUND, None, None
