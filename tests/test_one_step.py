"""One training step for every stage (verification.step.Step): what lint's simulated step rehearses is what
apply's gradients check runs, phase by phase, on a pipelined, a context-parallel, a compiled-loss and a
loss-parallel plan. The check reports the phases its ranks ran (`data.step`); lint's rehearsal keeps
those it ran (`Rehearsal.phases`); they must be the same lines, in the same order."""

from __future__ import annotations

import argparse
import json

import pytest

from .conftest import ROOT, shardlang_cli
from .test_compile import APPLIED

pytestmark = pytest.mark.distributed

#: A plan whose loss is compiled (and its modules): examples/mlp.py at world 2.
COMPILED_LOSS = APPLIED.replace("comms\n", "comms\ncompile loss (backend=aot_eager)\n")


def rehearsed(plan: str, model: str, world: int):
    """lint's simulated step on `plan` and `model` at `world`, as `shardlang lint` runs it."""
    from shardlang.cli.inputs import compile_plan, load_model, meta_model, order_for, plan_world
    from shardlang.explain.linting import lint_model
    from shardlang.explain.rehearsal import rehearse

    args = argparse.Namespace(model=model, entry=None, hf=None, seq=None, timeout=None)
    compiled, found, _ = compile_plan(plan, [], world)
    assert compiled is not None and not [d for d in found if d.is_error], found
    model_file = load_model(args)
    meta = meta_model(model_file)
    linted = lint_model(compiled, meta, plan_world(compiled, world), order_for(compiled, meta, model_file))
    assert linted.ok, linted.diagnostics
    return rehearse(compiled, meta, model_file, world, linted.resolution)


def applied_phases(plan: str, model: str, world: int) -> tuple[dict, list[str]]:
    done = shardlang_cli("apply", plan, model, "--nproc", str(world), "--json")
    report = json.loads(done.stdout)
    (gradients,) = [c for c in report["checks"] if c["check"] == "gradients"]
    return gradients, gradients["data"]["step"]


@pytest.mark.parametrize(
    ("plan", "model", "world", "telling"),
    [
        ("plans/llama_pipeline.sl", "examples/llama.py", 4, "forward and backward: a pipeline schedule"),
        ("plans/llama_cp.sl", "examples/llama.py", 4, "loss: the model file's loss"),
        ("plans/llama_loss_parallel.sl", "examples/llama.py", 4, "backward under loss_parallel"),
        ("compiled_loss", "examples/mlp.py", 2, "loss: the sum of the output"),
    ],
    ids=["pipelined", "context_parallel", "loss_parallel", "compiled_loss"],
)
def test_lint_rehearses_the_phases_apply_checks(monkeypatch, tmp_path, plan, model, world, telling):
    monkeypatch.chdir(ROOT)
    if plan == "compiled_loss":
        plan = str(tmp_path / "compiled_loss.sl")
        (tmp_path / "compiled_loss.sl").write_text(COMPILED_LOSS)
    rehearsal = rehearsed(plan, model, world)
    assert rehearsal.diagnostics == () and rehearsal.ran, rehearsal
    gradients, phases = applied_phases(plan, model, world)
    assert gradients["status"] == "pass", gradients["message"]
    assert list(rehearsal.phases) == phases
    assert any(line.startswith(telling) for line in phases), phases  # the plan's own phase is among them
    if "compiled_loss" in plan:  # compiled for real by apply; a simulated world compiles nothing
        assert gradients["data"]["loss_compiled_by"] == "torch.compile"


def test_a_step_that_differs_is_seen(monkeypatch):
    """The comparison can fail: the loss-parallel plan's phases are not the plain TP plan's."""
    monkeypatch.chdir(ROOT)
    plain = rehearsed("plans/llama_2d.sl", "examples/llama.py", 4)
    parallel = rehearsed("plans/llama_loss_parallel.sl", "examples/llama.py", 4)
    assert plain.phases and parallel.phases and plain.phases != parallel.phases
