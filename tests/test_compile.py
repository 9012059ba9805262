"""`compile TARGET, ... (options)`: torch.compile each matched module in place, after activation
checkpointing and before fully_shard (torchtitan's order); checked at parse and at resolve, lowered,
printed, rolled back, and applied under the gradients check."""

import json

import pytest
import torch

import shardlang
from examples.mlp import MLP
from shardlang.compiler import program as p
from shardlang.compiler.lower import lower
from shardlang.compiler.resolve import resolve
from shardlang.runtime.snapshot import Snapshot

from .conftest import shardlang_cli

PLAN = """shardlang 1
mesh world = cpu[dp=auto]
checkpoint net1
compile net1 (backend=aot_eager)
compile net2 (backend=aot_eager, fullgraph=true)
fully_shard on world.dp { each net1; each net2 }
verify gradients(steps=2), placements
"""


#: Applied under the gradients check: FSDP units over compiled modules. comms counts them run eagerly
#: (a dispatch mode cannot run inside a fullgraph-compiled module).
APPLIED = """shardlang 1
mesh world = cpu[dp=auto]
compile net1, net2 (backend=aot_eager, fullgraph=true)
fully_shard on world.dp { each net1; each net2 }
verify gradients(steps=2), placements, comms
"""


def _codes(text: str) -> list[tuple[str, int, int]]:
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads(text)
    return [(d.code, d.span.line, d.span.col) for d in raised.value.diagnostics]


def test_options_are_torch_compiles_keywords():
    plan = shardlang.loads(PLAN)
    assert [(str(c.target), c.options) for c in plan.compiles] == [
        ("net1", (("backend", "aot_eager"),)),
        ("net2", (("backend", "aot_eager"), ("fullgraph", True))),
    ]
    plan = shardlang.loads('compile layers.* (mode="max-autotune-no-cudagraphs", dynamic=false)')
    assert plan.compiles[0].options == (("mode", "max-autotune-no-cudagraphs"), ("dynamic", False))


def test_bad_options_are_diagnostics_at_them():
    assert _codes("compile net1 (fulgraph=true)") == [("SL101", 1, 15)]
    assert _codes('compile net1 (mode="fast")') == [("SL102", 1, 20)]
    assert _codes("compile net1 (backend=inductr)") == [("SL101", 1, 23)]
    assert _codes("compile net1 (fullgraph=yes)") == [("SL102", 1, 25)]
    assert _codes("compile net1 (dynamic=true, dynamic=false)") == [("SL103", 1, 29)]


def test_a_module_compiled_twice_or_inside_a_compiled_one_is_sl201():
    plan = shardlang.loads("compile net1\ncompile net1, net2\ncompile root\ncompile nett")
    _, found = resolve(plan, MLP())
    assert [(d.code, d.span.line, d.message) for d in found] == [
        ("SL201", 2, "module 'net1' is compiled twice (first at line 1)"),
        ("SL201", 3, "module 'root' is compiled, and so is 'net1' inside it (line 1)"),
        ("SL200", 4, found[2].message),
    ]


def test_compile_comes_after_checkpointing_and_before_fully_shard():
    plan = shardlang.loads(PLAN)
    resolution, found = resolve(plan, MLP())
    assert not found
    for program in (lower(plan, resolution, 2), lower(plan, None, None)):
        kinds = [type(s).__name__ for s in program.steps if not isinstance(s, p.MakeMesh)]
        assert kinds == ["Checkpoint", "Compile", "Compile", "FullyShard", "FullyShard", "FullyShard"]
    text = plan.to_python(MLP(), 2)
    compiled = text.index("model.get_submodule('net1').compile(backend='aot_eager')")
    assert text.index("checkpoint(model.get_submodule('net1'))") < compiled < text.index("fully_shard(")
    assert compiled < text.index(".compile(backend='aot_eager', fullgraph=True)") < text.index("fully_shard(")


def test_parallelize_module_calls_come_before_distribute_with_or_without_a_model():
    """SPEC §4.4's order does not depend on whether `compile` was given a model (issue 40 item 6: without
    one, a `distribute` rule written first was printed before the parallelize_module call)."""
    plan = shardlang.loads(
        "mesh world = cpu[tp=2]\nparallelize on world.tp {\n    net1 : distribute(input=replicate)\n"
        "    net2 : colwise\n}"
    )
    resolution, found = resolve(plan, MLP())
    assert not found
    for program in (lower(plan, resolution, 2), lower(plan, None, None)):
        kinds = [type(s).__name__ for s in program.steps if not isinstance(s, p.MakeMesh)]
        assert kinds[:2] == ["Parallelize", "Distribute"], kinds


def test_fullgraph_over_a_checkpointed_module_is_sl301_where_torch_cannot_run_it():
    """The limit in torchlimits says what the installed torch does: the case is run here."""
    from torch.distributed._composable import checkpoint

    from shardlang.compiler.lint import lint
    from shardlang.compiler.torchlimits import COMPILE_FULLGRAPH_CHECKPOINT, cannot

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    checkpoint(model[0])
    model.compile(backend="eager", fullgraph=True)
    try:
        model(torch.ones(2, 4, requires_grad=True)).sum().backward()
        raised = False
    except Exception:  # noqa: BLE001 - dynamo's Unsupported, whatever its module
        raised = True
    assert cannot(COMPILE_FULLGRAPH_CHECKPOINT) == raised
    plan = shardlang.loads("mesh world = cpu[dp=auto]\ncheckpoint net1\ncompile root (fullgraph=true)\ncompile net2")
    codes = [(d.code, d.span.line) for d in lint(plan, MLP(), 2).diagnostics if d.code == "SL301"]
    assert codes == ([("SL301", 3)] if raised else [])
    assert not [d for d in lint(shardlang.loads(PLAN), MLP(), 2).diagnostics if d.is_error]


def test_rollback_undoes_compile():
    model = MLP()
    snapshot = Snapshot.take(model)
    model.net1.compile(backend="eager")
    assert model.net1._compiled_call_impl is not None
    snapshot.restore()
    assert getattr(model.net1, "_compiled_call_impl", None) is None
    assert torch.equal(model(torch.ones(2, 16)), MLP.forward(model, torch.ones(2, 16)))


@pytest.mark.distributed
def test_compiled_fsdp_plan_passes_the_gradients_check(tmp_path):
    path = tmp_path / "compiled.sl"
    path.write_text(APPLIED)
    done = shardlang_cli("apply", path, "examples/mlp.py", "--nproc", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    checks = json.loads(done.stdout)["checks"]
    assert [(c["check"], c["status"]) for c in checks] == [
        ("gradients", "pass"),
        ("placements", "pass"),
        ("comms", "reported"),
    ]
    # the two units, run eagerly: each gathered for the forward and again for the backward, reduced once
    assert checks[2]["data"]["counts"] == {"_allgather_base_": 4, "_reduce_scatter_base_": 2}, checks[2]


#: A model file whose loss tells compiled code from eager: compiled, it adds the sum of the output,
#: so gradients taken through the compiled loss differ from the unsharded model's (eager) ones.
TELLING_LOSS = """import torch
from examples.mlp import build_model, example_input


def loss(output, inputs):
    mean = output.float().pow(2).mean()
    return mean + output.float().sum() if torch.compiler.is_compiling() else mean
"""


def test_compile_loss_is_the_model_files_loss_function():
    plan = shardlang.loads(
        "mesh world = cpu[tp=2]\ncompile net1, loss (backend=aot_eager)\nparallelize on world.tp { loss : colwise }"
    )
    assert [str(c.target) for c in plan.compiles] == ["net1"]
    assert plan.compile_loss.options == (("backend", "aot_eager"),)
    assert (plan.compile_loss.span.line, plan.compile_loss.span.col) == (2, 15)
    assert plan.parallelize[0].rules[0].target.segments == ("loss",)  # elsewhere `loss` is a module name
    assert _codes("compile loss\ncompile net1, loss (fullgraph=true)") == [("SL103", 2, 15)]
    assert shardlang.loads("compile net1").loss(abs) is abs
    braced = shardlang.loads("compile {loss}")  # a module called `loss` at the root
    assert braced.compile_loss is None and braced.compiles[0].target.segments == (("loss",),)
    compiled = plan.loss(abs)
    assert compiled is not abs and compiled is plan.loss(abs)  # compiled once
    assert compiled(torch.tensor(-2.0)) == 2.0


def test_compile_loss_is_printed(tmp_path):
    plan = shardlang.loads(
        "mesh world = cpu[dp=auto]\nfully_shard on world.dp { each net1 }\ncompile loss (backend=aot_eager, fullgraph=true)"
    )
    text = plan.to_python(MLP(), 2)
    assert "return compiled_loss(loss, backend='aot_eager', fullgraph=True)" in text
    namespace: dict = {}
    exec(compile(text, "printed.py", "exec", dont_inherit=True), namespace)
    compiled = namespace["loss_function"](lambda output, inputs: output.pow(2).mean())
    assert compiled(torch.ones(3), None) == 1.0


@pytest.mark.distributed
@pytest.mark.parametrize("compiled", [False, True])
def test_the_gradients_check_steps_the_compiled_loss(tmp_path, compiled):
    """The sharded model's loss is the compiled one (and the unsharded model's eager): a loss that
    computes something else when compiled fails the check only under `compile loss`."""
    (tmp_path / "telling.py").write_text(TELLING_LOSS)
    path = tmp_path / "plan.sl"
    path.write_text(APPLIED + ("compile loss (backend=aot_eager)\n" if compiled else ""))
    done = shardlang_cli("apply", path, tmp_path / "telling.py", "--nproc", "2", "--json", env={"PYTHONPATH": "."})
    report = json.loads(done.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["gradients"]["status"] == ("fail" if compiled else "pass"), done.stdout
    if compiled:  # named where it went wrong: the gradient the compiled loss sent back
        (finding,) = [d for d in report["diagnostics"] if "first disagreement" in d["message"]]
        assert "as the loss sent it back" in finding["message"]
        assert (finding["line"], finding["col"]) == (6, 9), finding


def test_the_finishing_order_hook_stays_out_of_compiled_code():
    """launch.raised.watching's global forward hook runs inside a compiled module's graph too, where
    torch 2.11's dynamo cannot trace it (every check of a fullgraph plan raised on the GPUs): it notes
    nothing there, and everything outside."""
    from shardlang.launch.raised import watching

    model = MLP()
    model.net1.compile(backend="eager", fullgraph=True)
    finished: dict[str, int] = {}
    with watching(model, finished):
        model(torch.ones(2, 16))
    assert "net1" not in finished and {"net2", "relu", ""} <= set(finished), finished
