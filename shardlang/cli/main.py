"""The `shardlang` command: argument parsing and rendering only; the work happens in the stages it calls."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import attrs
from rich.console import Console
from rich.text import Text

from .._version import __version__
from ..frontend.diagnostics import Diagnostic, PlanError, did_you_mean, render_all, render_json, sort_key
from ..frontend.ir import Plan
from ..frontend.read import read_file
from ..frontend.source import Source

if TYPE_CHECKING:  # torch is imported only where a command needs it: `lint` without a model never does
    from ..runtime.modelfile import ModelFile

#: Exit statuses (docs/language.md §5).
OK, FOUND, UNUSABLE = 0, 1, 2
#: Under torchrun, how long a failing rank other than 0 waits before it exits (see run_apply).
RANK0_GRACE_S = 10.0


class UsageError(Exception):
    """A command line that cannot be carried out (missing file, bad -D); exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse's usage errors (2), --help and --version (0): a status, not an exit
        return e.code if isinstance(e.code, int) else UNUSABLE
    try:
        return args.run(args)
    except UsageError as e:
        print(f"shardlang: error: {e}", file=sys.stderr)
        return UNUSABLE
    except KeyboardInterrupt:
        print("shardlang: interrupted (Ctrl-C); no worker is left running", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"shardlang: stopped by {e.name}; no worker is left running", file=sys.stderr)
        return 128 + e.signum


class Terminated(BaseException):
    """The launcher got SIGTERM (a scheduler, `kill`): raised where it runs, so the workers are stopped."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


@contextlib.contextmanager
def _terminable() -> Iterator[None]:
    """SIGTERM (and SIGHUP) raise Terminated in the main thread while workers run, as SIGINT raises
    KeyboardInterrupt: the pool kills its workers on the way out, and main prints one line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlang", description="Declarative sharding plans for PyTorch.")
    parser.add_argument("--version", action="version", version=f"shardlang {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lint = commands.add_parser("lint", help="check a plan (and, given a model, the plan against it)")
    lint.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    _add_model(lint, required=False)
    lint.add_argument(
        "--world", type=_positive, metavar="N", help="world size: resolves `auto` mesh dims and checks the meshes fit"
    )
    _add_params(lint)
    lint.add_argument(
        "--format", choices=("text", "json"), default="text", help="how to print diagnostics (default text)"
    )
    lint.add_argument(
        "--no-step",
        action="store_true",
        help="do not simulate a training step (fake tensors, a fake process group) to find what apply would hit",
    )
    lint.set_defaults(run=run_lint)

    apply = commands.add_parser(
        "apply", help="apply a plan to a model on N local workers (or under torchrun) and verify it"
    )
    apply.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    _add_model(apply, required=False)
    apply.add_argument(
        "--nproc",
        type=_positive,
        metavar="N",
        help="local worker processes (default: the size the meshes fix, or one per GPU)",
    )
    apply.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="gloo on cpu or nccl on cuda (default auto: cuda if there are enough GPUs)",
    )
    _add_params(apply)
    apply.add_argument(
        "--verify", metavar="LIST|none", help="checks to run, comma-separated, instead of the plan's (none: no checks)"
    )
    apply.add_argument("--steps", type=_positive, metavar="N", help="training steps of the gradients check")
    apply.add_argument(
        "--optimizer",
        choices=("sgd", "adam", "adamw"),
        help="the gradients check's optimizer, in place of the plan's",
    )
    apply.add_argument(
        "--seed", type=_seed, default=0, metavar="N", help="the seed every rank builds the model with (default 0)"
    )
    apply.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        metavar="S",
        help="how long workers may take to start, and then the job (default 600)",
    )
    apply.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    apply.add_argument(
        "--debug", action="store_true", help="with a failure, also print the full traceback (torch's frames included)"
    )
    apply.add_argument(
        "--load",
        metavar="DIR",
        help="after applying the plan, load a DCP checkpoint (any plan, any world size) or a directory of Hugging "
        "Face safetensors weights (each rank reads only its shards)",
    )
    apply.add_argument(
        "--save", metavar="DIR", help="save a checkpoint after the checks pass (with optimizer state if gradients ran)"
    )
    apply.add_argument(
        "--save-format",
        choices=("dcp", "hf"),
        default="dcp",
        help="--save as a DCP checkpoint (default), or as Hugging Face safetensors weights and config.json that "
        "from_pretrained reads (model only; every rank writes its shards, then rank 0 joins them into whole "
        "tensors, one at a time)",
    )
    apply.set_defaults(run=run_apply)

    explain = commands.add_parser(
        "explain", help="what every rank will hold and send, at any world size, in one CPU process"
    )
    explain.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    _add_model(explain, required=False)
    explain.add_argument("--world", type=_positive, metavar="N", required=True, help="the world size to simulate")
    explain.add_argument(
        "--rank", type=_non_negative, default=0, metavar="R", help="the rank whose view to show (default 0)"
    )
    _add_params(explain)
    explain.add_argument(
        "--param", metavar="PATTERN", help="only these parameters; with svg (or text), draw their shards"
    )
    explain.add_argument(
        "--format", choices=("text", "json", "svg"), default="text", help="text (default), json or svg"
    )
    explain.add_argument(
        "--no-step", dest="step", action="store_false", help="skip simulating a training step (no collectives; faster)"
    )
    explain.add_argument(
        "--full-step",
        action="store_true",
        help="simulate every block of a repeated stack (default: 2, 3 and 4 blocks, extrapolated when each block adds the same)",
    )
    explain.add_argument(
        "--batch", type=_positive, metavar="N", help="the per-replica batch handed to example_input (default 2 x TP)"
    )
    explain.add_argument(
        "--fit", metavar="MEMORY", help="also find the largest batch whose predicted peak fits MEMORY (e.g. 80GiB)"
    )
    explain.add_argument("--compare", metavar="PLAN", help="a second plan for the same model and world, side by side")
    explain.add_argument(
        "--gpu", default="h100", choices=("h100", "h200", "a100", "b200"), help="the accelerator of the time estimate"
    )
    explain.add_argument("--flops", metavar="FLOP/S", help="peak bf16 FLOP/s instead of the GPU's (e.g. 989e12)")
    explain.add_argument("--hbm", metavar="BYTES/S", help="HBM bandwidth instead of the GPU's (e.g. 3.35TB/s)")
    explain.add_argument(
        "--link",
        metavar="DIM=BW[:LAT],...",
        help="bandwidth (and latency) per mesh dim, e.g. dp=50GB/s:20us,tp=450GB/s; host=... is CPU offload's PCIe link",
    )
    explain.add_argument(
        "--gpus-per-node", type=_positive, default=8, metavar="N", help="which mesh dims stay inside a node (default 8)"
    )
    explain.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    explain.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        metavar="S",
        help="stop if loading the model or simulating the step takes longer (default 600)",
    )
    explain.set_defaults(run=run_explain)

    compile_ = commands.add_parser("compile", help="print the plan as plain torch code")
    compile_.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    _add_model(compile_, required=False)
    compile_.add_argument("--world", type=_positive, metavar="N", help="world size (default: what the meshes fix)")
    _add_params(compile_)
    compile_.add_argument("--emit", choices=("python",), required=True, help="what to print: python")
    compile_.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    compile_.set_defaults(run=run_compile)

    init = commands.add_parser(
        "init", help="write a starter plan for a model: FSDP2 on its repeated blocks, its own TP plan (transformers)"
    )
    _add_model(init, required=False)
    init.add_argument("--tp", type=_positive, default=1, metavar="N", help="tensor-parallel size (default 1: none)")
    init.add_argument(
        "--dp", type=_positive, metavar="N", help="data-parallel size (default: auto, what the world leaves)"
    )
    init.add_argument("-o", "--output", metavar="PLAN", help="write the plan to PLAN instead of stdout")
    init.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="only lint the plan: do not apply it and run its checks on CPU workers (tp x dp of them, dp 2 if auto)",
    )
    init.add_argument(
        "--timeout", type=_seconds, default=600.0, metavar="S", help="how long the check may take (default 600)"
    )
    init.set_defaults(run=run_init, plan=None, params=[], world=None)

    convert = commands.add_parser("convert", help="a checkpoint directory to a torch state dict file, or back")
    convert.add_argument("source", metavar="SOURCE", help="a checkpoint directory, or a .pt file of a state dict")
    convert.add_argument("target", metavar="TARGET", help="the .pt file to write, or the checkpoint directory")
    convert.add_argument(
        "--optimizer", action="store_true", help="checkpoint to file: write {'model': ..., 'optimizer': ...}"
    )
    convert.set_defaults(run=run_convert)
    return parser


def _add_model(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs=None if required else "?",
        help="model file defining build_model() (docs/language.md §6)",
    )
    parser.add_argument(
        "--entry", metavar="PKG.MODULE:FUNCTION", help="build_model as an importable function instead of MODEL"
    )
    parser.add_argument(
        "--hf",
        metavar="PATH",
        help="a Hugging Face transformers model instead of MODEL: a directory with config.json, or the file "
        "(built from the config; random token ids; the causal-LM loss; needs pip install 'shardlang[hf]')",
    )
    parser.add_argument(
        "--seq", type=_positive, metavar="N", help="with --hf: tokens per sequence of the example inputs (128)"
    )


def _model_file(args: argparse.Namespace) -> ModelFile | None:
    if args.model is None and args.entry is None and args.hf is None:
        return None
    from ..runtime.modelfile import ModelFileError, load_model_file

    with time_limit(getattr(args, "timeout", None), f"loading {_model_arg(args).strip()}"):
        try:
            return load_model_file(args.model, args.entry, hf=args.hf, seq=args.seq, keep_alive=True)
        except ModelFileError as e:
            raise UsageError(str(e)) from None


def _model_arg(args: argparse.Namespace) -> str:
    """The model as the command line named it: ` MODEL`, ` --entry E` or ` --hf PATH`, or ""."""
    if args.model:
        return f" {args.model}"
    return f" --entry {args.entry}" if args.entry else f" --hf {args.hf}" if args.hf else ""


class _TimedOut(BaseException):
    """Raised by time_limit's alarm inside user code (a BaseException, so that no `except Exception` eats it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Bound `what` (a model file's import, build_model, explain's simulated step) by `seconds`: a usage
    error when it runs longer. A SIGALRM timer, so only in the main thread (elsewhere: unbounded)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _TimedOut:
        raise UsageError(f"{what} took longer than --timeout {seconds:g} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _world(plan: Plan, given: int | None) -> int:
    if given is not None:
        return given
    try:
        return plan.fixed_world_size()
    except ValueError as e:
        raise UsageError(f"{e} with --world N") from None


def _add_params(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-D", dest="params", action="append", default=[], metavar="NAME=VALUE", help="override a `param` of the plan"
    )


#: The largest world size, rank or step count a flag takes (a world beyond it is not a real one).
MAX_COUNT = 2**31 - 1
#: The longest --timeout: a week (torch turns it into a timedelta, which overflows past ~10**9 days).
MAX_SECONDS = 7 * 24 * 3600.0
#: torch.manual_seed takes what fits in 64 bits, signed or unsigned.
SEEDS = range(-(2**63), 2**64)


def _integer(text: str, what: str, lowest: int, highest: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text[:40]!r}") from None
    if not lowest <= value <= highest:
        shown = str(value) if len(str(value)) <= 24 else f"a {len(str(value))}-digit number"
        raise argparse.ArgumentTypeError(f"expected {what} from {lowest} to {highest}, got {shown}")
    return value


def _positive(text: str) -> int:
    return _integer(text, "a positive integer", 1, MAX_COUNT)


def _non_negative(text: str) -> int:
    return _integer(text, "a non-negative integer", 0, MAX_COUNT)


def _seed(text: str) -> int:
    return _integer(text, "an integer seed (what torch.manual_seed takes)", SEEDS.start, SEEDS.stop - 1)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected seconds greater than 0 and at most {MAX_SECONDS:.0f}, got {text}")
    return value


def _params(pairs: list[str]) -> dict[str, str]:
    params = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"-D expects NAME=VALUE, got {pair!r}")
        params[name] = value
    return params


def compile_plan(
    path: str, params: list[str], world_size: int | None
) -> tuple[Plan | None, list[Diagnostic], dict[str, Source]]:
    """The front end for a command: diagnostics are returned, and an unreadable file is a usage error."""
    try:
        return read_file(path, _params(params), world_size)
    except OSError as e:
        raise UsageError(f"cannot read plan {path}: {e.strerror}") from None


def run_lint(args: argparse.Namespace) -> int:
    """Static checks; with a model, SL2xx too. SL1xx errors: exit 2 (no plan); SL2xx errors: exit 1."""
    plan, found, sources = compile_plan(args.plan, args.params, args.world)
    model_file = _model_file(args)
    note = ""
    if plan is not None and model_file is not None:
        model = _meta_model(model_file)
        world = _world(plan, args.world)
        linted = _lint_model(plan, model, world, _order(plan, model, model_file))
        found = sorted([*found, *linted.diagnostics], key=sort_key)
        if linted.ok and not args.no_step:
            from ..explain.rehearsal import rehearse

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


def _order(plan: Plan, model, model_file: ModelFile):
    """The order the model's modules run in, for the lint rules that follow activations through it (SL210:
    only plans with tensor parallelism need it)."""
    return _order_always(model, model_file) if plan.parallelize else None


def _order_always(model, model_file: ModelFile):
    """The order the model's modules run in, traced on meta from its example_input (compiler.trace)."""
    from ..compiler.trace import Order, trace_order

    if model_file.example_input is None:
        return Order(None, f"{model_file.origin} defines no example_input")
    try:
        with time_limit(TRACE_S, "its traced forward"):
            return trace_order(model, model_file.example_input)
    except UsageError:
        return Order(None, f"its forward did not finish within {TRACE_S:g} s")


#: How long the traced forward may run. It runs in the command's own process (lint, apply's launcher),
#: before any worker starts: a model whose forward never returns must not hang the command there, where
#: neither `--timeout` nor the workers' signals reach it.
TRACE_S = 10.0


def run_init(args: argparse.Namespace) -> int:
    """A starter plan on stdout (or -o), linted against the model at tp x dp (dp 2 where it is auto), then
    applied there on CPU workers with all its checks (unless --no-check). The plan is written all the same,
    to edit; the last line (stderr when the plan goes to stdout) says what was found: exit 0 when it lints
    clean and passes its checks, 1 when lint found errors or a check failed, 2 when the checks could not
    run (a model file without example_input says so, and exits 0 after a clean lint)."""
    from ..compiler.lint import lint
    from ..compiler.starter import init_plan
    from ..frontend.read import read_source

    _check_output(args.output)
    model_file = _model_file(args)
    if model_file is None:
        raise UsageError(
            "init needs a model: MODEL (a file defining build_model), --entry package.module:function or --hf PATH"
        )
    model = _meta_model(model_file)
    order = _order_always(model, model_file)
    text = init_plan(model, tp=args.tp, dp=args.dp, name=_model_arg(args).strip(), order=order)
    source = Source(args.output or "<init>", text)
    plan, found = read_source(source, None, None)
    world = plan.meshes[0].fixed_size * (1 if args.dp else 2) if plan is not None else args.tp * (args.dp or 2)
    if plan is not None:
        found = sorted([*found, *lint(plan, model, world, order=order).diagnostics], key=sort_key)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    emit_diagnostics(found, {source.name: source}, "text", stream=sys.stderr)
    linted = f"linted at world {world}: {'clean' if not found else f'{len(found)} diagnostics'}"
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
    return _check_init(args, plan, source, model_file, world, order)


def _said(args: argparse.Namespace, what: str) -> None:
    """init's verdict: after `wrote PLAN` on stdout, or on stderr when the plan itself went to stdout."""
    if args.output:
        print(f"wrote {args.output} ({what})")
    else:
        print(f"shardlang init: {what}", file=sys.stderr)


def _check_init(args: argparse.Namespace, plan: Plan, source: Source, model_file: ModelFile, world: int, order) -> int:
    """Apply init's plan at `world` on CPU workers (gloo), as `apply --device cpu` does, with its checks."""
    from ..launch.job import Job
    from ..launch.workers import WorkerError

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the plan's `auto` mesh means cpu here, as on the workers
    job = Job(plan, {}, args.model, args.entry, plan.checks, 0, model_file=model_file if args.hf else None, order=order)
    console = Console(file=sys.stderr, highlight=False)
    try:
        with _terminable():
            report, _ = _run_local(job, world, "cpu", args.timeout, console, False, _Out(json=False))
    except WorkerError as e:
        _worker_failed(e, {source.name: source}, False, _Out(json=False))
        _said(args, f"applied at world {world} on CPU: it did not run to the end; do not train with it as it is")
        return UNUSABLE
    counts = report.summary
    if report.ok and report.usable:
        _said(args, f"linted clean and applied at world {world} on CPU: {counts or 'every check passed'}")
        return OK
    from ..launch.report import render

    render(report, {source.name: source}, Console(file=sys.stderr, highlight=False, soft_wrap=True))
    _said(args, f"applied at world {world} on CPU, its checks FAILED ({counts}): edit it before training with it")
    return FOUND


def run_compile(args: argparse.Namespace) -> int:
    """The program as Python on stdout (or -o); diagnostics on stderr. A plan that does not compile: 2."""
    from ..emit.python import compile_python

    _check_output(args.output)
    plan, found, sources = compile_plan(args.plan, args.params, args.world)
    model_file = _model_file(args)
    code = None
    if plan is not None:
        model = _meta_model(model_file) if model_file is not None else None
        model_arg = _model_arg(args)
        world_arg = f" --world {args.world}" if args.world else ""
        command = f"shardlang compile {args.plan}{model_arg}{world_arg} --emit python"
        try:
            code = compile_python(plan, model, _world(plan, args.world) if model is not None else args.world, command)
        except PlanError as e:
            found = sorted([*found, *e.diagnostics], key=sort_key)
    emit_diagnostics(found, sources, "text", stream=sys.stderr)
    if code is None:
        return UNUSABLE
    if args.output:
        _write(args.output, code)
    else:
        sys.stdout.write(code)
    return OK


class _Out:
    """Where `apply` prints its result: with --json, exactly one JSON object on stdout, whichever way the
    command ends (a report, a plan that cannot be used, a check that raised, a worker that died, a timeout,
    a usage error, Ctrl-C). Knows what the run has learnt so far, for an object printed on the way out."""

    def __init__(self, json: bool):
        self.json, self.printed = json, False
        self.world, self.device = 0, ""
        self.pool = None  # the local workers, once started: what each rank last said

    def report(self, report) -> None:
        if self.json and not self.printed:
            self.printed = True
            print(report.json(), flush=True)

    def failed(self, status: int, failure: dict, diagnostics=(), ranks=None) -> None:
        """The object of a run that ended without a report."""
        from ..launch.report import Report

        if ranks is None:
            ranks = self.pool.ranks() if self.pool is not None else []
        self.report(
            Report(
                ok=False,
                world_size=self.world,
                device=self.device,
                diagnostics=tuple(diagnostics),
                usable=False,
                exit_status=status,
                failure=failure,
                ranks=tuple(ranks),
            )
        )


def run_apply(args: argparse.Namespace) -> int:
    """Compile and lint here, then run the job on every rank; rank 0's report. Exit 0 / 1 (SL400) / 2.
    With --json, one object on stdout on every way out (main prints the line on stderr as always)."""
    out = _Out(args.json)
    try:
        return _apply(args, out)
    except UsageError as e:
        out.failed(UNUSABLE, {"kind": "usage", "message": str(e)})
        raise
    except KeyboardInterrupt as e:
        message = "interrupted (Ctrl-C); no worker is left running"
        out.failed(130, {"kind": "interrupted", "message": message}, ranks=getattr(e, "ranks", None))
        raise
    except Terminated as e:
        message = f"stopped by {e.name}; no worker is left running"
        out.failed(128 + e.signum, {"kind": "terminated", "message": message}, ranks=getattr(e, "ranks", None))
        raise
    except Exception as e:
        # A bug of shardlang's own: the traceback follows on stderr, and Python exits with status 1.
        out.failed(1, {"kind": "internal", "message": f"{type(e).__name__}: {e}"})
        raise


def _apply(args: argparse.Namespace, out: _Out) -> int:
    from ..compiler.lint import lint
    from ..launch.workers import WorkerError, under_torchrun

    if args.save_format != "dcp" and args.save is None:
        raise UsageError(f"--save-format {args.save_format} says how --save writes: give --save DIR too")
    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
    out.world = world or 0
    device = _apply_device(args.device, world)
    out.device = f"{device} ({'nccl' if device == 'cuda' else 'gloo'})"
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # an `auto` mesh means cpu here, as on the workers
    plan, found, sources = compile_plan(args.plan, args.params, world)
    if plan is None:
        return _apply_unusable(found, sources, out, world or 0, device)
    if world is None:
        world = _default_nproc(plan, device)
    out.world = world
    model_file = _model_file(args)
    if model_file is None:
        raise UsageError(
            "apply needs a model: MODEL (a file defining build_model), --entry package.module:function or --hf PATH"
        )
    checks = _checks(plan, args)
    explicit = args.verify is not None or any(c.span is not None for c in plan.checks)
    needs_input = [c.name for c in checks if c.name in ("gradients", "comms")]
    if explicit and needs_input and model_file.example_input is None:
        raise UsageError(
            f"{model_file.origin} defines no example_input(batch, generator), which {' and '.join(needs_input)} need"
        )
    meta = _meta_model(model_file, args.timeout)
    if next(meta.parameters(), None) is None:
        raise UsageError(
            f"build_model() from {model_file.origin} returned a model without parameters: nothing to shard"
        )
    order = _order(plan, meta, model_file)
    linted = lint(plan, meta, world, order=order)
    if not linted.ok:
        return _apply_unusable(sorted([*found, *linted.diagnostics], key=sort_key), sources, out, world, device)
    try:
        _check_checkpoint_paths(args, meta)
    except PlanError as e:
        return _apply_unusable([*found, *e.diagnostics], sources, out, world, device)

    from ..launch.job import Job

    job = Job(
        args.plan,
        _params(args.params),
        args.model,
        args.entry,
        checks,
        args.seed,
        model_file=model_file if args.hf else None,  # crosses to the workers by its config's path
        load=args.load,
        save=args.save,
        save_format=args.save_format,
        explicit=explicit,
        order=order,
    )
    console = Console(file=sys.stderr, highlight=False)
    warnings: list[str] = []
    if torchrun:
        rank = int(os.environ["RANK"])
        out.json = out.json and rank == 0  # rank 0 prints the object; under torchrun it knows only itself
        try:
            # torchrun stops the other ranks with SIGTERM when one fails: rank 0 still prints its object
            with _terminable():
                report = _run_under_torchrun(job, device, console)
        except WorkerError as e:  # this rank's own failure
            status = _worker_failed(e, sources, args.debug, out)
            if rank != 0:
                # torchrun stops every rank once one exits: rank 0, likely failing alike, gets a moment to
                # say so in its object before it is stopped
                time.sleep(RANK0_GRACE_S)
            _exit_now(status)
        _exit_now(OK if report is None else _show_report(report, warnings, sources, args, out))  # None: not rank 0
    try:
        with _terminable():
            report, warnings = _run_local(job, world, device, args.timeout, console, args.debug, out)
    except WorkerError as e:
        return _worker_failed(e, sources, args.debug, out)
    if args.debug and report.details:
        print(report.details.rstrip(), file=sys.stderr)
    return _show_report(report, warnings, sources, args, out)


def _worker_failed(error, sources: dict[str, Source], debug: bool, out: _Out) -> int:
    """A job that failed on a worker: a check that raised is SL400 at its statement (exit 1); otherwise one
    line naming the rank, and the frames of the user's own files (exit 2). --debug adds the traceback.
    With --json, the object says the same: the failure, the exit status and what each rank said."""
    status = FOUND if error.diagnostic is not None and error.diagnostic.code == "SL400" else UNUSABLE
    failure = {"kind": error.kind, "rank": error.rank, "message": error.headline, "user_frames": list(error.user)}
    out.failed(status, failure, error.diagnostics, error.ranks)
    if error.diagnostics:
        emit_diagnostics(list(error.diagnostics), sources, "text", stream=sys.stderr)
    else:
        print(f"shardlang: error: {error.headline}", file=sys.stderr)
        for frame in error.user:
            print(f"  at {frame}", file=sys.stderr)
    if debug and error.details:
        print(f"rank {error.rank}'s traceback:\n{error.details.rstrip()}", file=sys.stderr)
    elif error.details and error.diagnostic is None:
        print("  (run with --debug for the full traceback)", file=sys.stderr)
    return status


def _show_report(report, warnings: list[str], sources: dict[str, Source], args: argparse.Namespace, out: _Out) -> int:
    """Print the report (table or JSON) and return the exit status it calls for."""
    from ..launch.report import render

    status = UNUSABLE if not report.usable else OK if report.ok else FOUND
    report = attrs.evolve(report, warnings=report.warnings + tuple(warnings), exit_status=status)
    if args.json:
        out.report(report)
    else:
        render(report, sources, Console(file=sys.stdout, highlight=False, soft_wrap=True))
    return status


def _check_checkpoint_paths(args: argparse.Namespace, meta) -> None:
    """Before any worker starts: --load names a checkpoint or HF weights that fit the model (from metadata
    and headers alone), --save a replaceable path."""
    from ..checkpoints.formats import check_target, check_weights_fit, read_weights

    if args.load is not None:
        check_weights_fit(read_weights(args.load), meta)
    if args.save is not None:
        check_target(args.save, args.save_format)


def run_convert(args: argparse.Namespace) -> int:
    """DCP checkpoint -> torch file, or torch file -> checkpoint; diagnostics (SL501) and exit 2 if not."""
    from ..checkpoints.converting import convert_checkpoint

    try:
        done = convert_checkpoint(args.source, args.target, optimizer=args.optimizer)
    except PlanError as e:
        emit_diagnostics(list(e.diagnostics), {}, "text", stream=sys.stderr)
        return UNUSABLE
    print(f"wrote {done.path}: {done.describe()}")
    return OK


def run_explain(args: argparse.Namespace) -> int:
    """Per-parameter layouts, per-rank memory, one step's collectives, peak memory and time at `--world N`
    (docs/language.md §8); `--compare` a second plan, `--fit` the largest batch."""
    from ..explain.options import ExplainOptions
    from ..explain.pictures import render_compare, render_svg, render_text
    from ..explain.simulate import explain
    from ..explain.timing import hardware, parse_number, parse_size

    _check_output(args.output)
    model_file = _model_file(args)
    if model_file is None:
        raise UsageError(
            "explain needs a model: MODEL (a file defining build_model), --entry package.module:function or --hf PATH"
        )
    if not 0 <= args.rank < args.world:
        raise UsageError(f"--rank {args.rank} is not in a world of {args.world}")
    try:
        machine = hardware(
            args.gpu,
            parse_number(args.flops, "FLOP/s") if args.flops else None,
            parse_number(args.hbm) if args.hbm else None,
            args.link,
            args.gpus_per_node,
        )
        fit = parse_size(args.fit) if args.fit else None
        options = ExplainOptions(args.world, args.rank, args.param, args.step, args.full_step, args.batch, machine, fit)
    except ValueError as e:
        raise UsageError(str(e)) from None
    explanations = []
    for path in (args.plan, args.compare) if args.compare else (args.plan,):
        plan, found, sources = compile_plan(path, args.params, args.world)
        if plan is None:
            emit_diagnostics(found, sources, "text", stream=sys.stderr)
            return UNUSABLE
        try:
            with time_limit(args.timeout, "explain (building the model and simulating the step)"):
                explanations.append(explain(plan, _meta_model(model_file), options, model_file))
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
        if args.compare:
            render_compare(*explanations, console)
        text = stream.getvalue() if args.output else None
    if text is not None and args.output:
        _write(args.output, text)
    elif text is not None:
        sys.stdout.write(text)
    return OK


def _check_output(path: str | None) -> None:
    """`-o FILE` names a file that can be written: checked before the work, so that a typo costs nothing."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory (-o takes a file name)")
    folder = target.parent
    if not folder.is_dir():
        raise UsageError(f"cannot write {path}: no directory {folder}")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"cannot write {path}: permission denied")


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def explanation_data(explanation, pattern: str | None) -> dict:
    from ..explain.simulate import select
    from ..frontend.ir import to_data

    data = to_data(explanation)
    data["tensors"] = [to_data(t) for t in select(explanation, pattern)]
    data["collectives"] = [to_data(c) for c in explanation.collectives]
    data["notes"] = list(explanation.notes)
    for key in ("this_rank", "largest", "smallest"):
        data[key] = to_data(getattr(explanation, key))
    data["spread"] = explanation.spread
    return data


def _apply_device(choice: str, world: int | None) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no GPU is available")
    if choice != "auto":
        return choice
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    from ..launch.workers import under_torchrun

    return "cuda" if gpus and (world is None or world <= gpus or under_torchrun()) else "cpu"


def _default_nproc(plan: Plan, device: str) -> int:
    try:
        return plan.fixed_world_size()
    except ValueError:
        if device == "cuda":
            import torch

            return torch.cuda.device_count()
        raise UsageError("the plan's meshes have auto dims: give --nproc N") from None


def _checks(plan: Plan, args: argparse.Namespace) -> tuple:
    """The checks to run: the plan's, or --verify's (with the plan's arguments where it has them)."""
    from ..frontend.ir import Check
    from ..frontend.schema import CHECKS

    checks = plan.checks
    if args.verify is not None:
        names = [] if args.verify.strip() == "none" else [n.strip() for n in args.verify.split(",") if n.strip()]
        unknown = [n for n in names if n not in CHECKS]
        if unknown:
            hint = did_you_mean(unknown[0], CHECKS)
            raise UsageError(
                f"unknown check '{unknown[0]}' in --verify"
                + (f"; {hint[0]}" if hint else f"; checks: {', '.join(CHECKS)}")
            )
        given = {c.name: c for c in plan.checks}
        checks = tuple(given.get(n) or Check(n, (), None) for n in names)
    for name in ("steps", "optimizer"):
        value = getattr(args, name)
        if value is not None:
            checks = tuple(
                attrs.evolve(c, args=tuple((k, v) for k, v in c.args if k != name) + ((name, value),))
                if c.name == "gradients"
                else c
                for c in checks
            )
    return checks


def _apply_unusable(found, sources, out: _Out, world: int, device: str) -> int:
    # The report (and the checks it describes) is imported here, not at the top: `lint` never needs it.
    from ..launch.report import Report

    if out.json:
        out.report(
            Report(
                ok=False, world_size=world, device=device, diagnostics=tuple(found), usable=False, exit_status=UNUSABLE
            )
        )
    else:
        emit_diagnostics(found, sources, "text", stream=sys.stderr)
    return UNUSABLE


def _run_local(job, world: int, device: str, timeout: float, console: Console, debug: bool, out: _Out):
    """The job on `world` local workers; their stderr (torch's and gloo's logs) is kept in a temporary
    directory and printed only with --debug, after a failure."""
    import tempfile

    from ..launch.job import run
    from ..launch.workers import WorkerError, WorkerPool

    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="shardlang-logs-") as logs:
        try:
            with console.status(f"starting {world} workers ({backend})") as status:

                def show(rank: int, message: str) -> None:
                    if rank == 0:
                        status.update(f"rank 0: {message}")

                pool = WorkerPool(world, backend, timeout_s=timeout, on_progress=show, log_dir=logs)
                out.pool = pool
                try:
                    report = pool.run(run, job, timeout_s=timeout)[0]
                finally:
                    warnings = pool.close()
        except WorkerError:
            if debug:
                _print_logs(logs)
            raise
    return report, warnings


def _print_logs(folder: str) -> None:
    for path in sorted(Path(folder).glob("rank*.log")):
        text = path.read_text(errors="replace").rstrip()
        if text:
            print(f"--- {path.stem}'s stderr ---\n{text}", file=sys.stderr)


def _run_under_torchrun(job, device: str, console: Console):
    """Join torchrun's process group; rank 0 returns the report, the others None."""
    import torch
    import torch.distributed as dist

    from ..launch.job import run
    from ..launch.workers import destroy_process_groups

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = int(os.environ["RANK"])
    try:
        report = run(job)
    except Exception as e:  # noqa: BLE001 - this rank's failure, said as the local launcher says a worker's
        from ..launch.workers import error_of

        raise error_of(rank, e) from None
    finally:
        destroy_process_groups()
    return report if rank == 0 else None


def _exit_now(status: int) -> NoReturn:
    """End a torchrun worker without running C++ static destructors.

    Even after a collection, something can keep a gloo group alive until interpreter exit, where
    its destructor aborts the process with its threads still joinable
    (torch 2.13: "terminate called without an active exception", so torchrun reports a failure
    after a job that passed). The report is printed and the groups destroyed; flush and leave.
    """
    import logging

    logging.shutdown()  # what atexit would have done for log files the model file opened
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _meta_model(model_file: ModelFile, timeout: float | None = None):
    from ..runtime.modelfile import ModelFileError

    with time_limit(timeout, f"build_model() from {model_file.origin}"):
        try:
            return model_file.build_on_meta(keep_alive=True)
        except ModelFileError as e:
            raise UsageError(str(e)) from None


def emit_diagnostics(found: list[Diagnostic], sources: dict[str, Source], form: str, stream=None) -> None:
    """Diagnostics on stdout (or `stream`): JSON, or text coloured when the stream is a terminal."""
    stream = stream or sys.stdout
    if form == "json":
        print(render_json(found), file=stream)
        return
    if not found:
        return
    text = render_all(found, sources)
    console = Console(file=stream, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        print(text, file=stream)
        return
    styled = Text(text)
    styled.highlight_regex(r"error\[SL\d+\]", "bold red")
    styled.highlight_regex(r"warning\[SL\d+\]", "bold yellow")
    styled.highlight_regex(r"(?m)^\s*\|\s*\^+.*$", "red")
    styled.highlight_regex(r"= help:", "bold cyan")
    console.print(styled)


if __name__ == "__main__":
    sys.exit(main())
