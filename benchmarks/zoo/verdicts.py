"""What each shardlang command of the sweep said (init's last line, lint's JSON list, apply's JSON report),
and a (family, mode) record judged as issue 41 counts it: outcome, lint against apply, the failure's class."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import attrs

from benchmarks.zoo.build import ROOT, first_line


@attrs.frozen
class Ran:
    """One shardlang command's exit status, output and seconds (exit None: it ran past its timeout)."""

    exit: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def crashed(self) -> bool:
        """Exit 2 with a Python traceback, or a timeout: what the issue counts as a crash."""
        return self.exit is None or (
            self.exit == 2 and "Traceback (most recent call last)" in self.stdout + self.stderr
        )

    def tail(self, chars: int = 600) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-chars:]


def shardlang(args: list[str], timeout: float) -> Ran:
    command = [sys.executable, "-m", "shardlang", *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return Ran(None, out, err + f"\ntimed out after {timeout:.0f} s", time.perf_counter() - start)
    return Ran(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


CODE = re.compile(r"\b(SL\d{3})\b")
WORLD = re.compile(r"linted at world (\d+)")


def init_verdict(ran: Ran) -> dict:
    """init's exit, its last line (the verdict), the codes its static lint printed, the world it linted at."""
    text = ran.stdout + ran.stderr
    world = WORLD.search(text)
    return {
        "exit": ran.exit,
        "said": first_line(ran.stdout.strip().splitlines()[-1] if ran.stdout.strip() else ran.tail(200)),
        "codes": sorted(set(CODE.findall(ran.stderr))),
        "world": int(world.group(1)) if world else None,
        "seconds": round(ran.seconds, 1),
    }


def lint_verdict(ran: Ran) -> dict:
    """lint's verdict from its JSON list: clean, errors (their codes), or crash (no list: exit 2 or timeout)."""
    try:
        diagnostics = json.loads(ran.stdout)
    except ValueError:
        return {"verdict": "crash", "exit": ran.exit, "said": _last_words(ran), "seconds": round(ran.seconds, 1)}
    errors = [d for d in diagnostics if d.get("severity") == "error"]
    return {
        "verdict": "errors" if errors else "clean",
        "exit": ran.exit,
        "codes": [d["code"] for d in errors],
        "warnings": sorted({d["code"] for d in diagnostics if d.get("severity") != "error"}),
        "said": first_line(errors[0]["message"])[:300] if errors else "",
        "seconds": round(ran.seconds, 1),
    }


def apply_verdict(ran: Ran) -> dict:
    """apply's verdict from its JSON report: pass, fail (a check failed, or an error diagnostic), or crash
    (no report: exit 2 before or outside the checks, or a timeout)."""
    try:
        report = json.loads(ran.stdout)
    except ValueError:
        return {"verdict": "crash", "exit": ran.exit, "said": _last_words(ran), "seconds": round(ran.seconds, 1)}
    checks = {c["check"]: c["status"] for c in report.get("checks", [])}
    failed = [c for c in report.get("checks", []) if c.get("status") == "fail"]
    errors = [d for d in report.get("diagnostics", []) if d.get("severity") == "error"]
    said = f"{failed[0]['check']}: {first_line(failed[0]['message'])}" if failed else ""
    said = said or (first_line(errors[0]["message"]) if errors else report.get("summary", ""))
    return {
        "verdict": "pass" if report.get("ok") else ("fail" if failed or errors else "crash"),
        "exit": ran.exit,
        "checks": checks,
        "codes": [d["code"] for d in errors],
        "said": said[:300],
        "seconds": round(ran.seconds, 1),
    }


def _last_words(ran: Ran) -> str:
    """What a command that gave no JSON said last: its `error:` line, else the last line of its output."""
    text = ran.stderr + "\n" + ran.stdout
    errors = [line.strip() for line in text.splitlines() if "error:" in line or "Error" in line]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (errors[-1] if errors else lines[-1] if lines else f"exit {ran.exit}")[:300]


def judged(record: dict) -> dict:
    """The record's outcome (pass, fail, crash, timed out, not built), lint against apply, and its failure's
    class."""
    if "built" in record and record["built"] is not True:
        return {"outcome": "not built", "agreement": "-", "class": None}
    lint, applied = record.get("lint"), record.get("apply")
    if lint is None:  # init wrote no plan: a crash (a traceback, a timeout), or init refusing the model, saying why
        outcome = "crash" if record.get("crash", True) else "init refused"
        return {"outcome": outcome, "agreement": "-", "class": f"init: {normalised(record['init']['said'])}"}
    outcome = "crash" if record["crash"] else {"pass": "pass", "fail": "fail"}.get(applied["verdict"], "crash")
    if lint["verdict"] == "crash":
        agreement = "lint crash"
    elif lint["verdict"] == "clean":
        agreement = "agree" if applied["verdict"] == "pass" else "miss"
    else:
        agreement = "false alarm" if applied["verdict"] == "pass" else "agree"
    named = failure_class(record, agreement)
    if outcome == "crash" and "timed out after" in (applied.get("said") or "") + (record.get("tail") or ""):
        # the model slower than the sweep's --timeout (Mamba's reference kernels on one CPU thread), no traceback
        outcome = "timed out"
    if outcome == "crash" and named is None:  # every verdict given, yet a command hung or died after it
        last = (record.get("tail") or "").strip().splitlines()[-1:]
        named = f"crash after the verdicts: {normalised(last[0] if last else '')}"
    return {"outcome": outcome, "agreement": agreement, "class": named}


def failure_class(record: dict, agreement: str) -> str | None:
    """The first diagnostic code (lint's, else apply's) or failed check, and a short normalised message."""
    lint, applied = record["lint"], record["apply"]
    if applied["verdict"] == "pass" and agreement == "agree":
        return None
    if lint["verdict"] == "errors" or lint["verdict"] == "crash":
        code = (lint.get("codes") or ["crash"])[0]
        return f"lint {code}: {normalised(lint['said'])}"
    failed = next((c for c, status in applied.get("checks", {}).items() if status == "fail"), None)
    code = (applied.get("codes") or [failed or applied["verdict"]])[0]
    return f"apply {code}: {normalised(applied['said'])}"


def normalised(message: str) -> str:
    """A message with its names and numbers blanked, so that one failure on many families reads alike."""
    message = re.sub(r"'[^']*'|`[^`]*`|\"[^\"]*\"", "'_'", message)
    message = re.sub(r"\b[A-Za-z_]\w*(\.[\w*]+)+", "_._", message)
    message = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", message)
    return message.split(";")[0][:100]
