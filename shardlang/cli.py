"""The `shardlang` command: argument parsing and rendering only; the work happens in the stages it calls."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.text import Text

from . import __version__
from .compile import compile_python, default_world_size
from .diagnostics import Diagnostic, PlanError, render_all, render_json, sort_key
from .frontend import compile_file
from .lint import lint
from .modelfile import ModelFile, ModelFileError, load_model_file
from .plan import Plan
from .source import Source

#: Exit statuses (SPEC §5).
OK, FOUND, UNUSABLE = 0, 1, 2


class UsageError(Exception):
    """A command line that cannot be carried out (missing file, bad -D); exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as e:
        print(f"shardlang: error: {e}", file=sys.stderr)
        return UNUSABLE
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlang", description="Declarative sharding plans for PyTorch.")
    parser.add_argument("--version", action="version", version=f"shardlang {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lint = commands.add_parser("lint", help="check a plan (and, given a model, the plan against it)")
    lint.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    _add_model(lint, required=False)
    lint.add_argument("--world", type=_positive, metavar="N", help="world size: resolves `auto` mesh dims and checks the meshes fit")
    _add_params(lint)
    lint.add_argument("--format", choices=("text", "json"), default="text", help="how to print diagnostics (default text)")
    lint.set_defaults(run=run_lint)

    compile_ = commands.add_parser("compile", help="print the plan as plain torch code")
    compile_.add_argument("plan", metavar="PLAN", help="the .sl plan file")
    _add_model(compile_, required=False)
    compile_.add_argument("--world", type=_positive, metavar="N", help="world size (default: what the meshes fix)")
    _add_params(compile_)
    compile_.add_argument("--emit", choices=("python",), required=True, help="what to print: python")
    compile_.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    compile_.set_defaults(run=run_compile)
    return parser


def _add_model(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("model", metavar="MODEL", nargs=None if required else "?", help="model file defining build_model() (SPEC §6)")
    parser.add_argument("--entry", metavar="PKG.MODULE:FUNCTION", help="build_model as an importable function instead of MODEL")


def _model_file(args: argparse.Namespace) -> ModelFile | None:
    if args.model is None and args.entry is None:
        return None
    try:
        return load_model_file(args.model, args.entry)
    except ModelFileError as e:
        raise UsageError(str(e)) from None


def _world(plan: Plan, given: int | None) -> int:
    if given is not None:
        return given
    try:
        return default_world_size(plan)
    except ValueError as e:
        raise UsageError(f"{e} with --world N") from None


def _add_params(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-D", dest="params", action="append", default=[], metavar="NAME=VALUE", help="override a `param` of the plan")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _params(pairs: list[str]) -> dict[str, str]:
    params = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"-D expects NAME=VALUE, got {pair!r}")
        params[name] = value
    return params


def compile_plan(path: str, params: list[str], world_size: int | None) -> tuple[Plan | None, list[Diagnostic], dict[str, Source]]:
    """The front end for a command: diagnostics are returned, and an unreadable file is a usage error."""
    try:
        return compile_file(path, _params(params), world_size)
    except OSError as e:
        raise UsageError(f"cannot read plan {path}: {e.strerror}") from None


def run_lint(args: argparse.Namespace) -> int:
    """Static checks; with a model, SL2xx too. SL1xx errors: exit 2 (no plan); SL2xx errors: exit 1."""
    plan, found, sources = compile_plan(args.plan, args.params, args.world)
    model_file = _model_file(args)
    if plan is not None and model_file is not None:
        model = _meta_model(model_file)
        found = sorted([*found, *lint(plan, model, _world(plan, args.world)).diagnostics], key=sort_key)
    emit_diagnostics(found, sources, args.format)
    if plan is None:
        return UNUSABLE
    if args.format == "text" and not found:
        print(f"{args.plan}: no problems found")
    return FOUND if any(d.is_error for d in found) else OK


def run_compile(args: argparse.Namespace) -> int:
    """The program as Python on stdout (or -o); diagnostics on stderr. A plan that does not compile: 2."""
    plan, found, sources = compile_plan(args.plan, args.params, args.world)
    model_file = _model_file(args)
    code = None
    if plan is not None:
        model = _meta_model(model_file) if model_file is not None else None
        model_arg = f" {args.model}" if args.model else f" --entry {args.entry}" if args.entry else ""
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
        Path(args.output).write_text(code)
    else:
        sys.stdout.write(code)
    return OK


def _meta_model(model_file: ModelFile):
    try:
        return model_file.build_on_meta()
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
