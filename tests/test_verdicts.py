"""Plans users wrote against earlier releases keep their verdicts (CHANGELOG.md, SPEC §12).

tests/fixtures/verdicts/ holds such plans (old versions of plans/ files, fixtures since deleted, and the
plans of issue 39) and manifest.json pins each one's verdict: lint's exit status and diagnostics (code
and position) without its simulated step (`lint`) and with it (`lint_step`), and for a few, apply's
exit status and every check's status at world 2. A pinned verdict
that changes fails here until CHANGELOG.md says why and the pin is updated: the pin then carries `was`
(the verdict before) and `since` (the CHANGELOG heading whose entry names the plan's file).

`lint` pins run in this process (the fast lane); `lint_step` pins fork the simulated step, and apply pins
run on the shared gloo pool (both in the distributed lane).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re

import pytest

from .conftest import FIXTURES, ROOT

VERDICTS = FIXTURES / "verdicts"
CHANGELOG = ROOT / "CHANGELOG.md"
PINS = json.loads((VERDICTS / "manifest.json").read_text(encoding="utf-8"))["pins"]
#: The optional extras a model file needs, by the module it imports.
EXTRAS = {"transformers": "hf", "torchtitan": "titan"}

HOW_TO_UPDATE = (
    "A pinned verdict changed. If the change is intended, add an entry to CHANGELOG.md saying what "
    "changed for this plan and why (naming {plan}), then update its pin in tests/fixtures/verdicts/"
    "manifest.json: the new verdict, `was` (the old one) and `since` (the CHANGELOG heading of the entry). "
    "If it is not intended, a plan that worked before no longer does: fix the code, not the pin."
)


def _ids(pins):
    return [pin["plan"] for pin in pins]


def _needs(pin) -> list:
    """pytest marks skipping a pin whose model needs an optional extra that is not installed."""
    text = (ROOT / pin["model"]).read_text(encoding="utf-8")
    missing = [
        extra
        for module, extra in EXTRAS.items()
        if re.search(rf"^\s*(from|import) {module}\b", text, re.MULTILINE) and importlib.util.find_spec(module) is None
    ]
    return [pytest.mark.skip(reason=f"needs pip install -e '.[{missing[0]}]'")] if missing else []


def _params(kind: str):
    pins = [pin for pin in PINS if kind in pin]
    return [pytest.param(pin, id=pin["plan"], marks=_needs(pin) + _forks(pin, kind)) for pin in pins]


def _forks(pin, kind: str) -> list:
    """lint runs a plan's `use` styles in a forked simulated world (to predict what they place), even
    without its step: such a pin is in the distributed lane."""
    import shardlang

    uses = kind == "lint" and shardlang.load(VERDICTS / pin["plan"]).uses
    return [pytest.mark.distributed] if uses else []


def _mismatch(pin, what: str, pinned, found) -> str:
    return f"{pin['plan']}: {what} was pinned as {pinned}, is now {found}.\n" + HOW_TO_UPDATE.format(plan=pin["plan"])


def _lint(pin, *flags: str) -> tuple[dict, str]:
    """`shardlang lint PLAN MODEL --world N [flags]` in this process: its exit status and every diagnostic
    as `CODE line:col`; and what it printed on stderr."""
    from shardlang.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    argv = ["lint", str(VERDICTS / pin["plan"]), pin["model"], "--world", str(pin["world"]), "--format", "json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([*argv, *flags])
    found = [f"{d['code']} {d['line']}:{d['col']}" for d in json.loads(out.getvalue() or "[]")]
    return {"exit": status, "diagnostics": found}, err.getvalue()


@pytest.mark.parametrize("pin", _params("lint"))
def test_lint_verdict_is_pinned(pin, monkeypatch):
    """lint without its simulated step (`--no-step`: no process, the fast lane): the static checks and
    the rules against the model's module tree."""
    monkeypatch.chdir(ROOT)  # as a user runs it: `use` paths import from here
    verdict, err = _lint(pin, "--no-step")
    pinned = {"exit": pin["lint"]["exit"], "diagnostics": pin["lint"]["diagnostics"]}
    assert verdict == pinned, _mismatch(pin, "lint --no-step's verdict", pinned, verdict) + f"\nstderr: {err}"


@pytest.mark.distributed  # the simulated step runs in a forked child
@pytest.mark.parametrize("pin", _params("lint_step"))
def test_lint_step_verdict_is_pinned(pin, monkeypatch):
    """lint as a user runs it with a model: the simulated training step too (SL220-SL222)."""
    monkeypatch.chdir(ROOT)
    verdict, err = _lint(pin)
    pinned = {"exit": pin["lint_step"]["exit"], "diagnostics": pin["lint_step"]["diagnostics"]}
    assert verdict == pinned, _mismatch(pin, "lint's verdict", pinned, verdict) + f"\nstderr: {err}"


@pytest.mark.distributed
@pytest.mark.parametrize("pin", _params("apply"))
def test_apply_verdict_is_pinned(pin, pools, monkeypatch):
    """`shardlang apply PLAN MODEL --nproc N`, on the shared pool: exit status and each check's status;
    where the pin names the module a failure must be found at, the failing check's message names it."""
    import shardlang
    from shardlang.launch.job import Job, run

    monkeypatch.chdir(ROOT)
    path = VERDICTS / pin["plan"]
    checks = shardlang.load(path).checks
    job = Job(str(path), {}, str(ROOT / pin["model"]), None, checks, explicit=True)
    report = pools(pin["world"]).run(run, job)[0]
    verdict = {"exit": report.exit_code, "checks": {c.check: c.status for c in report.checks}}
    pinned = {"exit": pin["apply"]["exit"], "checks": pin["apply"]["checks"]}
    assert verdict == pinned, _mismatch(pin, "apply's verdict", pinned, verdict) + "\n" + report.json()
    for check, module in pin["apply"].get("names", {}).items():
        (result,) = [c for c in report.checks if c.check == check]
        assert module in result.message, f"{pin['plan']}: {check} should name {module}: {result.message}"


def test_changelog_names_every_changed_verdict():
    """CHANGELOG.md exists; every pin's `since` is one of its headings; and a pin whose verdict changed
    from an earlier pin (`was`) is named, by its plan's file name, in that heading's section."""
    assert CHANGELOG.exists(), "CHANGELOG.md is missing: every change to a plan's verdict is listed there"
    sections = _sections(CHANGELOG.read_text(encoding="utf-8"))
    for pin in PINS:
        since = pin["since"]
        assert since in sections, f"{pin['plan']}: `since` names no CHANGELOG.md heading: '## {since}'"
        if "was" in pin:
            assert pin["plan"] in sections[since], (
                f"{pin['plan']}: its verdict changed (was: {pin['was']}), but the CHANGELOG.md section "
                f"'{since}' does not name it"
            )


def test_every_pin_has_its_plan_and_every_plan_its_pin():
    """No plan of the corpus without a pin (it would judge nothing), no pin without its files."""
    plans = sorted(p.name for p in VERDICTS.glob("*.sl"))
    assert sorted(_ids(PINS)) == plans
    for pin in PINS:
        assert (ROOT / pin["model"]).exists(), pin
        assert {"lint", "lint_step", "apply"} & set(pin), f"{pin['plan']} pins no verdict"
        assert pin.get("origin"), f"{pin['plan']}: say where the plan comes from"


def _sections(text: str) -> dict[str, str]:
    """CHANGELOG.md's `## ` headings, each with the text under it."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2])}


def test_sections_reads_headings():
    """_sections finds a heading and its text (so the changelog test above can fail)."""
    sections = _sections("# Changelog\n\n## A (x)\n- plan.sl: why\n\n## B\n- other\n")
    assert sections == {"A (x)": "\n- plan.sl: why\n\n", "B": "\n- other\n"}
    assert "plan.sl" not in sections["B"]


def test_a_moot_skip_leaves_no_request_unanswered_only_beside_a_check_that_ran():
    """Which requested skips make the run exit 2 (launch.report.unanswered_checks), over every rank's
    results merged (verification.combine): a moot skip (the plan gave the check nothing to compare)
    beside a check that ran is no unanswered request; alone it is; a skip for want of what the check
    needed always is; `init` after --load never is; a skip moot on one rank only is not moot."""
    from shardlang.launch.report import Report, unanswered_checks
    from shardlang.verification import FAIL, PASS, SKIPPED, CheckResult, combine

    def result(check, status, moot=False):
        return CheckResult(check, status, "nothing compared: ..." if status == SKIPPED else "", 0.1, moot=moot)

    moot, passed = result("module_states", SKIPPED, moot=True), result("gradients", PASS)
    assert unanswered_checks((passed, moot), explicit=True, loaded=False) == ()
    assert unanswered_checks((moot,), explicit=True, loaded=False) == (moot,)  # nothing ran at all
    assert unanswered_checks((result("gradients", FAIL), moot), explicit=True, loaded=False) == ()
    wanting = result("placements", SKIPPED)  # no tensor had a prediction: not moot
    assert unanswered_checks((passed, wanting), explicit=True, loaded=False) == (wanting,)
    assert unanswered_checks((passed, wanting), explicit=False, loaded=False) == ()  # the default checks
    init = result("init", SKIPPED)
    assert unanswered_checks((passed, init), explicit=True, loaded=True) == ()

    merged = combine([[moot], [result("module_states", SKIPPED)]])[0]
    assert merged.status == SKIPPED and not merged.moot
    assert combine([[moot], [moot]])[0].moot
    exits = {
        "passed beside a moot skip": Report(ok=True, world_size=2, device="cpu", checks=(passed, moot)),
        "a check failed": Report(ok=False, world_size=2, device="cpu", checks=(result("gradients", FAIL),)),
        "unanswered": Report(ok=False, world_size=2, device="cpu", checks=(moot,), usable=False),
    }
    assert {k: r.exit_code for k, r in exits.items()} == {
        "passed beside a moot skip": 0,
        "a check failed": 1,
        "unanswered": 2,
    }


def test_a_use_that_takes_a_built_in_name_is_the_plan_own_style(tmp_path, monkeypatch):
    """SL108 (SPEC §12): `use ... as mla_kv_a_proj`, written before mla_kv_a_proj was built in, is a
    warning at the alias, and the printed program runs the plan's own style under that name, with the
    arguments the plan gives it; the same rule without the `use` prints the built-in."""
    import shardlang
    from shardlang.cli.main import main

    monkeypatch.chdir(ROOT)
    planted = VERDICTS / "deepseek_v2_mla_use_planted.sl"
    (warning,) = shardlang.load(planted).diagnostics
    assert (warning.code, warning.span.line, warning.span.col, warning.is_error) == ("SL108", 5, 65, False)
    assert "tests.fixtures.verdicts.mla_styles_planted.mla_kv_a_proj" in warning.message
    builtin = tmp_path / "builtin.sl"
    builtin.write_text(re.sub(r"^use .*\n", "", planted.read_text(encoding="utf-8"), flags=re.MULTILINE))
    printed = {}
    for name, path in (("own", planted), ("builtin", builtin)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert main(["compile", str(path), "--world", "2", "--emit", "python"]) == 0
        printed[name] = out.getvalue()
    own, built_in = printed["own"], printed["builtin"]
    assert "from tests.fixtures.verdicts.mla_styles_planted import mla_kv_a_proj\n" in own
    assert "world['tp'], mla_kv_a_proj, rope=8)" in own and "MlaKvAProjParallel" not in own
    assert "MlaKvAProjParallel(rope=8))" in built_in and "import mla_kv_a_proj" not in built_in
