"""The field bed (issue 23): verdicts on model code nobody on the team wrote. Eight transformers
families beyond examples/, and torchtitan's own Llama3 and Qwen3-MoE (examples/field/), each with a
correct plan (plans/field/, which must pass every check) and a planted mistake a user would make
(tests/fixtures/field/, which must fail naming the module its header names). The correct plans are
applied by tests/test_apply_cli.py's every-plan test, with the marks FIELD_PLANS gives them here; this
file applies the planted ones. Skipped without the extras: pip install -e '.[hf]' (transformers),
'.[titan]' (torchtitan)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from benchmarks.field_verdicts import PLANS, PLANTED, QUOTED, RAISED_IN, cases, model_of, names
from shardlang.launch.job import Job, run
from shardlang.launch.workers import WorkerError

from .conftest import ROOT

HAS = {name: importlib.util.find_spec(name) is not None for name in ("transformers", "torchtitan")}
WORLD = 2  # tp 2 (dp 1): the smallest world that splits anything, on the session's shared pool

#: Correct plans that fail today because of a shardlang defect, by plan stem. Strict: when the defect is
#: fixed, the test says so and the entry must go. (Empty since issue 23's float64 truth for grouped_mm,
#: the references built by parameter name, and recursive `init meta with FN`.)
KNOWN_DEFECTS: dict[str, str] = {}

#: Planted mistakes whose verdict is wrong today because of a shardlang defect, by fixture stem.
KNOWN_PLANTED_DEFECTS: dict[str, str] = {}  # (DeepSeek-V2's MLA, a miss until gradients compared slices)


def _needs(stem: str) -> str:
    return "torchtitan" if stem.startswith("titan") else "transformers"


def _marks(stem: str, defects: dict[str, str]) -> list:
    needs = _needs(stem)
    marks = [
        pytest.mark.skipif(
            not HAS[needs], reason=f"needs {needs}: pip install -e '.[{'titan' if needs == 'torchtitan' else 'hf'}]'"
        )
    ]
    if stem in defects:
        marks.append(pytest.mark.xfail(strict=True, reason=defects[stem]))
    return marks


#: For tests/test_apply_cli.py's every-plan test: each correct field plan, skipped without its extra,
#: expected to fail (strictly) where a known defect stands in its way.
FIELD_PLANS = [
    pytest.param(p, marks=_marks(p.stem, KNOWN_DEFECTS), id=f"field-{p.stem}") for p in sorted(PLANS.glob("*.sl"))
]
PLANTED_PLANS = [
    pytest.param(p, marks=_marks(p.stem, KNOWN_PLANTED_DEFECTS), id=p.stem) for p in sorted(PLANTED.glob("*.sl"))
]


def test_the_bed_covers_what_issue_23_asks_for():
    """At least eight transformers families beyond examples/, and torchtitan's Llama3 and Qwen3-MoE, each with
    a correct plan and a planted mistake naming a module, and nothing in examples/field/ without a plan."""
    found = cases()
    families = {c.family for c in found}
    assert {"titan_llama3", "titan_qwen3_moe"} <= families
    assert len({f for f in families if not f.startswith("titan")}) >= 8
    assert {c.family for c in found if c.module is None} == {c.family for c in found if c.module is not None}
    models = {p.stem for p in (ROOT / "examples" / "field").glob("*.py")} - {"common"}
    assert models == families


@pytest.mark.parametrize(
    "plan", [pytest.param(p, marks=_marks(p.stem, {}), id=p.stem) for p in sorted(PLANS.glob("*.sl"))]
)
def test_field_plan_lints_clean_at_world_4(plan):
    import shardlang
    from shardlang.runtime.modelfile import load_model_file

    with torch.device("meta"):
        model = load_model_file(str(ROOT / model_of(plan))).build_model()
    errors = [d for d in shardlang.load(plan).lint(model, world_size=4) if d.is_error]
    assert not errors, [str(d.message) for d in errors]


@pytest.mark.distributed
@pytest.mark.parametrize("planted", PLANTED_PLANS)
def test_planted_mistake_fails_naming_its_module(pools, planted):
    """The planted plan fails (a failed check, or an error diagnostic), and the report names the module
    the mistake is in: the gradients check's localised module, or the module of the diagnostic."""
    import shardlang

    text = planted.read_text()
    module = re.search(r"^# names: (\S+)$", text, re.MULTILINE).group(1)
    source = PLANS / (re.search(r"on plans/field/(\w+)\.sl", text).group(1) + ".sl")
    job = Job(str(planted), {}, str(ROOT / model_of(source)), None, shardlang.load(planted).checks)
    try:
        report = pools(WORLD).run(run, job)[0]
    except WorkerError as e:
        # A check that raised in the model's code is a verdict when it names the module whose code raised
        # (SL400 at its rule); anything else that raised is a crash.
        inside = [RAISED_IN.search(d.message) for d in e.diagnostics]
        named = [m.group(1) for m in inside if m]
        assert named, f"crashed: {e}"
        assert names(named[0], module), named
        return
    assert not report.ok, "missed: every check passed"
    failed = [c for c in report.checks if c.status == "fail"]
    errors = [d for d in report.diagnostics if d.is_error]
    localised = [c.data["localised"]["module"] for c in failed if (c.data or {}).get("localised")]
    if localised:
        assert names(localised[0], module), localised
    else:  # an error diagnostic (lint) naming the module or one of its tensors
        assert errors and names(", ".join(QUOTED.findall(errors[0].message)), module), [d.message for d in errors]
