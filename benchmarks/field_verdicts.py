"""Verdicts on model code nobody on the team wrote (issue 23): every field plan, correct or planted, run
through `shardlang apply --json` and judged against what it should say.

    python benchmarks/field_verdicts.py [--device cpu|cuda] [--nproc 2] [--only FAMILY ...]

The cases come from the files themselves (examples/field/, plans/field/, tests/fixtures/field/): a plan in
plans/field/ must pass every check; a planted mistake in tests/fixtures/field/ (a correct plan with one
error a user would make, its header naming the plan it came from and the module a verdict must name)
must fail, naming that module. Each row: family, plan, expected, got (pass / fail / raised in a module it names / crash), the module
the report named, and the judgement (right, false alarm, miss, crash, wrong module). Target: every row
right. Families whose packages are missing (transformers: '.[hf]', torchtitan: '.[titan]') are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans" / "field"
PLANTED = ROOT / "tests" / "fixtures" / "field"


@attrs.frozen
class Case:
    """One (family, plan) pair and what its verdict must be."""

    family: str
    plan: Path
    model: str  # path relative to the repository
    module: str | None  # None: every check must pass; else the module a failing verdict must name

    @property
    def expected(self) -> str:
        return "pass" if self.module is None else "fail"

    @property
    def needs(self) -> str:
        return "torchtitan" if self.family.startswith("titan") else "transformers"


def model_of(plan: Path) -> str:
    return re.search(r"Model: (\S+\.py)", plan.read_text()).group(1)


def family_of(model: str) -> str:
    return Path(model).stem  # examples/field/<family>.py


def cases() -> list[Case]:
    """Every correct plan, then every planted mistake, each sorted by family."""
    found = [Case(family_of(model_of(p)), p, model_of(p), None) for p in sorted(PLANS.glob("*.sl"))]
    for planted in sorted(PLANTED.glob("*.sl")):
        text = planted.read_text()
        source = PLANS / (re.search(r"on plans/field/(\w+)\.sl", text).group(1) + ".sl")
        module = re.search(r"^# names: (\S+)$", text, re.MULTILINE).group(1)
        found.append(Case(family_of(model_of(source)), planted, model_of(source), module))
    return found


@attrs.frozen
class Verdict:
    got: str  # pass, fail, raised (in a module the report names) or crash
    module: str | None  # the module the report named (a localised failure or a diagnostic), if any
    note: str  # the first line of what went wrong, for the table's last column
    seconds: float

    def judge(self, case: Case) -> str:
        if self.got == "crash" or (self.got == "raised" and case.module is None):
            return "crash"
        if case.module is None:
            return "right" if self.got == "pass" else "false alarm"
        if self.got == "pass":
            return "miss"
        return "right" if names(self.module, case.module) else "wrong module"


QUOTED = re.compile(r"'([A-Za-z_][\w.]*)'")
#: The module a check that raised was running (launch.job's SL400 'raised in module ...').
RAISED_IN = re.compile(r"^raised in module '([^']*)'")


def names(named: str | None, module: str) -> bool:
    """Whether what a report named (comma-separated) is `module` or one of its own tensors. `module` may
    hold `*` for one name segment: a mistake in a rule on `layers.*` is in every layer, and a report
    rightly names whichever it meets first (backward meets the last layer first)."""
    pattern = re.compile(r"[^.]+".join(map(re.escape, module.split("*"))))
    return any(pattern.fullmatch(n) or pattern.fullmatch(n.rpartition(".")[0]) for n in (named or "").split(", "))


def named_module(report: dict) -> str | None:
    """What a failing report points at: the gradients check's localised module, else the quoted dotted
    names of the first error diagnostic (lint errors name their modules or tensors so), comma-separated."""
    for check in report.get("checks", []):
        where = (check.get("data") or {}).get("localised")
        if check.get("status") == "fail" and where and where.get("module"):
            return where["module"]
    for diagnostic in report.get("diagnostics", []):
        if diagnostic.get("severity") == "error":
            found = QUOTED.findall(diagnostic.get("message", ""))
            if found:
                return ", ".join(found)
    return None


def margin(report: dict) -> str:
    """How close a passing plan came to a false alarm: the gradients check's worst tensor (or slice of
    one), as a fraction of its allowance."""
    for check in report.get("checks", []):
        worst = (check.get("data") or {}).get("worst") if check.get("check") == "gradients" else None
        if worst:
            return f"worst {worst[0]['ratio']:.2f} of allowed ({worst[0]['tensor']})"
    return ""


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def verdict_of(stdout: str, stderr: str, seconds: float) -> Verdict:
    """pass: the report is ok. fail: a check failed or the plan has an error diagnostic. crash: anything
    else (no report, a check or worker that raised, a timeout)."""
    try:
        report = json.loads(stdout)
    except ValueError:
        return Verdict("crash", None, first_line(stderr)[:160] or "no report", seconds)
    if report.get("ok"):
        return Verdict("pass", None, margin(report), seconds)
    errors = [d for d in report.get("diagnostics", []) if d.get("severity") == "error"]
    if any("raised" in d.get("message", "") for d in errors):
        # A check that raised in the model's code, pinned on the module whose code raised (SL400 at its
        # rule): a verdict on a planted mistake when that is the module; a crash where nothing is named.
        inside = [RAISED_IN.search(d.get("message", "")) for d in errors]
        named = next((m.group(1) for m in inside if m), None)
        return Verdict("raised" if named else "crash", named, errors[0]["message"][:160], seconds)
    failed = [c for c in report.get("checks", []) if c.get("status") == "fail"]
    if failed or errors:
        note = f"{failed[0]['check']}: {first_line(failed[0]['message'])}" if failed else errors[0]["message"]
        return Verdict("fail", named_module(report), note[:160], seconds)
    return Verdict("crash", None, (first_line(stderr) or report.get("summary", ""))[:160], seconds)


def run_case(case: Case, device: str, nproc: int, timeout: int) -> Verdict:
    plan = case.plan
    if device != "cpu":  # the plans say `auto`; force the device asked for
        text = re.sub(r"= auto\[", f"= {device}[", plan.read_text())
        plan = Path(tempfile.mkdtemp()) / plan.name
        plan.write_text(text)
    command = [sys.executable, "-m", "shardlang", "apply", str(plan), case.model, "--nproc", str(nproc), "--json"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Verdict("crash", None, f"timed out after {timeout} s", time.perf_counter() - start)
    return verdict_of(done.stdout, done.stderr, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--only", nargs="*", help="families to run (default: all)")
    args = parser.parse_args()
    rows, tally = [], {}
    for case in cases():
        if args.only and case.family not in args.only:
            continue
        if importlib.util.find_spec(case.needs) is None:
            print(f"skipped {case.plan.name}: {case.needs} is not installed", file=sys.stderr)
            continue
        verdict = run_case(case, args.device, args.nproc, args.timeout)
        judged = verdict.judge(case)
        tally[judged] = tally.get(judged, 0) + 1
        rows.append((case, verdict, judged))
        print(f"{case.plan.name}: {verdict.got} ({judged}, {verdict.seconds:.0f} s)", file=sys.stderr)

    print(f"field verdicts, world {args.nproc} on {args.device}")
    header = ("family", "plan", "expected", "got", "module named", "verdict", "s", "what it said")
    table = [
        (
            c.family,
            str(c.plan.relative_to(ROOT)),
            c.expected if c.module is None else f"fail: {c.module}",
            v.got,
            v.module or "-",
            j,
            f"{v.seconds:.0f}",
            v.note or "-",
        )
        for c, v, j in rows
    ]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header) - 1)]
    for row in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    print(", ".join(f"{n} {k}" for k, n in sorted(tally.items())))


if __name__ == "__main__":
    main()
