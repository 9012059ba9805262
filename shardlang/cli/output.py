"""What the commands print: diagnostics (text or JSON), apply's one JSON object on every way out, explain's
JSON, and the files -o writes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from ..frontend.diagnostics import Diagnostic, render_all, render_json
from ..frontend.source import Source
from .status import UsageError


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


class Out:
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


def check_output(path: str | None) -> None:
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


def write_output(path: str, text: str) -> None:
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
