"""The result of `shardlang apply`: one report from every rank's checks, as a table or as JSON (docs/checks.md)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from attrs import field, frozen
from rich.console import Console
from rich.table import Table

from ..frontend.diagnostics import Diagnostic, render_all
from ..frontend.source import Source
from ..verification import PASS, SKIPPED, CheckResult, summary

if TYPE_CHECKING:
    from ..checkpoints.records import Transfer


@frozen
class Report:
    ok: bool
    world_size: int
    device: str
    checks: tuple[CheckResult, ...] = ()
    diagnostics: tuple[Diagnostic, ...] = ()  # lint warnings, and errors when the plan or a check failed
    warnings: tuple[str, ...] = ()  # not diagnostics of the plan: e.g. a worker's abnormal teardown
    #: What the run says about itself, which is no warning: a check asked for that compared nothing where that
    #: leaves the request unanswered (why the run exits 2), a --save not done because a check failed. In the JSON's `warnings`, ahead of the warnings.
    notes: tuple[str, ...] = ()
    seconds: dict[str, float] = field(factory=dict)  # apply, checks, total
    layout: str = ""
    checkpoints: dict[str, Transfer] = field(factory=dict)  # "loaded" and "saved", where --load / --save ran
    usable: bool = True  # False: the plan or the model could not be used (exit status 2)
    details: str = ""  # the traceback behind a failed apply (SL300), shown by `--debug`; not in the JSON
    # Set by the command: the status it exits with; for a run that ended without every rank's report (a
    # check that raised, a worker that died, a timeout, Ctrl-C), what ended it and what each rank said.
    exit_status: int | None = None
    failure: dict[str, Any] | None = None
    ranks: tuple[dict[str, Any], ...] = ()

    @property
    def ran(self) -> tuple[CheckResult, ...]:
        """The checks that compared something (passed, failed or reported)."""
        return tuple(c for c in self.checks if c.status != SKIPPED)

    @property
    def skipped(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.status == SKIPPED)

    @property
    def exit_code(self) -> int:
        """The status `apply` exits with for this report (docs/commands.md): 2 when the run could not be
        used (a requested check left unanswered among them), 1 when a check failed, else 0."""
        return 2 if not self.usable else 0 if self.ok else 1

    @property
    def summary(self) -> str:
        return summary(self.checks)

    def to_json(self) -> dict[str, Any]:
        """SPEC §7's object: one entry per check with its status (pass, fail, skipped, reported); only
        `pass` is a pass. `skipped` repeats the skipped ones with their reasons."""
        return {
            "ok": self.ok,
            "world_size": self.world_size,
            "device": self.device,
            "summary": self.summary,
            "checks": [c.to_json() for c in self.checks],
            "skipped": [{"check": c.check, "message": c.message} for c in self.skipped],
            "diagnostics": [d.to_json() for d in self.diagnostics],
            "warnings": [*self.notes, *self.warnings],
            "checkpoint": {
                k: self.checkpoints[k].to_json() if k in self.checkpoints else None for k in ("loaded", "saved")
            },
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "exit_status": self.exit_status,
            "failure": self.failure,
            "ranks": list(self.ranks),
        }

    def json(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def unanswered_checks(checks: tuple[CheckResult, ...], explicit: bool, loaded: bool) -> tuple[CheckResult, ...]:
    """The requested checks that ended `skipped` and so leave the run without an answer (exit 2). Not
    among them: `init` after `--load` (the weights were loaded, not initialised: the user's choice), and a
    moot skip (the plan gives the check nothing to compare, e.g. module_states where nothing has replicas)
    while some other requested check ran (SPEC §12); a run where no requested check ran answers nothing.
    Without `explicit` (the plan has no `verify`, no --verify) the default checks answer no request."""
    if not explicit:
        return ()
    ran = any(c.status != SKIPPED for c in checks)
    return tuple(
        c for c in checks if c.status == SKIPPED and not (c.check == "init" and loaded) and not (c.moot and ran)
    )


def render(report: Report, sources: dict[str, Source], console: Console) -> None:
    """The text report: a heading, the table (check, result, worst error, seconds), each check's message,
    then any diagnostics."""
    console.print(
        f"[bold]world {report.world_size} on {report.device}[/bold]" + (f", {report.layout}" if report.layout else "")
    )
    if report.checks:
        table = Table(show_edge=True, header_style="bold")
        for column, justify in (
            ("check", "left"),
            ("result", "left"),
            ("error / allowed", "right"),
            ("seconds", "right"),
        ):
            table.add_column(column, justify=justify)
        for c in report.checks:
            result = {PASS: "[green]pass[/green]", SKIPPED: "[yellow]skipped[/yellow]"}.get(
                c.status, "[red]FAIL[/red]" if c.ok is False else "[cyan]reported[/cyan]"
            )
            worst = "-" if c.worst is None else f"{c.worst:.2e}"
            table.add_row(c.check, result, worst, f"{c.seconds:.2f}")
        console.print(table)
        for c in report.checks:
            console.print(f"  {c.check}: {c.message}", highlight=False, markup=False)
    if report.diagnostics:
        console.print(render_all(report.diagnostics, sources), highlight=False, markup=False)
    for kind, transfer in report.checkpoints.items():
        console.print(f"{kind} {transfer.path}: {transfer.describe()}", highlight=False, markup=False)
    for note in report.notes:  # plain, as the run's own account: the verdict below says how it ended
        console.print(f"note: {note}", highlight=False, markup=False)
    for warning in report.warnings:
        console.print(f"warning: {warning}", highlight=False, markup=False, style="yellow")
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
    colour = "red" if not report.ok else "green" if all(c.status == PASS for c in report.checks) else "yellow"
    verdict = report.summary if report.usable else "failed"
    console.print(f"[{colour}]{verdict}[/{colour}] ({timing})")
