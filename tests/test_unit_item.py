"""`unit A, B (...)` in a fully_shard block: one FSDP2 unit over every module its targets match
(`fully_shard([norm, output])`, as torchtitan groups the last norm and the output layer). Parsed, resolved,
linted, lowered, printed, explained (one all-gather and one reduce-scatter fewer than a unit each) and
applied under the gradients check."""

import pytest

import shardlang
from examples.llama import build_model
from shardlang.compiler import program as p
from shardlang.compiler.lint import lint
from shardlang.compiler.lower import lower
from shardlang.compiler.resolve import resolve

UNIT = """shardlang 1
mesh world = cpu[dp=auto]
fully_shard on world.dp {
    each layers.*
    unit norm, output (reshard_after_forward=false)
}
"""
#: The same units, norm and output each its own.
APART = UNIT.replace(
    "unit norm, output (reshard_after_forward=false)",
    "each norm (reshard_after_forward=false)\n    each output (reshard_after_forward=false)",
)


def _codes(text: str, model=None) -> list[tuple[str, int, str]]:
    plan = shardlang.loads(text)
    found = lint(plan, model or build_model(), 2).diagnostics
    return [(d.code, d.span.line, d.message) for d in found if d.is_error]


def test_a_unit_item_is_one_unit_over_every_target():
    (block,) = shardlang.loads(UNIT).units
    each, unit = block.units
    assert (str(each), each.together) == ("each layers.*", False)
    assert (str(unit), unit.together, unit.get("reshard_after_forward")) == ("unit norm, output", True, False)
    resolution, found = resolve(shardlang.loads(UNIT), build_model())
    assert not found
    assert [u.fqns for u in resolution.units] == [("layers.0",), ("layers.1",), ("norm", "output"), ("",)]


def test_one_target_matching_several_modules_makes_one_unit():
    plan = shardlang.loads(UNIT.replace("unit norm, output", "unit layers.*"))
    resolution, _ = resolve(plan, build_model())
    assert ("layers.0", "layers.1") in [u.fqns for u in resolution.units]


def test_unit_is_checked_like_each():
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads("mesh world = cpu[dp=auto]\nreplicate on world.dp { unit norm, output }")
    assert [(d.code, d.span.line) for d in raised.value.diagnostics] == [("SL101", 2)]
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads("mesh world = cpu[dp=auto]\nfully_shard on world.dp { unit norm (reshard=false) }")
    assert [d.code for d in raised.value.diagnostics] == ["SL101"]
    assert _codes(UNIT.replace("unit norm, output", "unit norm, outptu")) == [
        ("SL200", 5, _codes(UNIT.replace("unit norm, output", "unit norm, outptu"))[0][2])
    ]
    assert _codes(UNIT.replace("unit norm, output", "unit layers.0, layers.0.attention")) == [
        ("SL201", 5, "`unit layers.0, layers.0.attention` lists 'layers.0.attention' and 'layers.0', which holds it")
    ]
    assert _codes(UNIT.replace("    each layers.*", "    each output")) == [
        ("SL201", 4, "module 'output' is made a fully_shard unit twice")
    ]


def test_the_program_wraps_the_list_after_the_units_inside_it():
    plan = shardlang.loads(UNIT)
    resolution, _ = resolve(plan, build_model())
    units = [s for s in lower(plan, resolution, 2).steps if isinstance(s, p.FullyShard)]
    assert [(s.module, s.also, s.together) for s in units] == [
        ("layers.0", (), False),
        ("layers.1", (), False),
        ("norm", ("output",), True),
        ("", (), False),
    ]
    text = plan.to_python(build_model(), 2)
    assert "fully_shard([model.get_submodule('norm'), model.get_submodule('output')], mesh=world, " in text
    anywhere = plan.to_python(None, None)
    assert "(('norm', 'output'), 'fully_shard', lambda modules: fully_shard(modules, mesh=world," in anywhere


@pytest.mark.distributed
def test_explain_counts_one_all_gather_and_one_reduce_scatter_fewer(tmp_path, capsys):
    """torch's FSDPMemTracker hooks each module of such a unit apart (an extra gather and reduce); explain
    keeps fully_shard's group hooks, and counts what FSDP runs."""
    from shardlang.cli.main import main

    counts = {}
    for name, text in (("unit", UNIT), ("apart", APART)):
        path = tmp_path / f"{name}.sl"
        path.write_text(text)
        assert main(["explain", str(path), "examples/llama.py", "--world", "4"]) == 0
        out = capsys.readouterr().out
        counts[name] = {
            op: int(line.split("│")[3])
            for line in out.splitlines()
            for op in ("_allgather_base_", "_reduce_scatter_base_")
            if f" {op} " in line
        }
    assert counts["apart"]["_allgather_base_"] == counts["unit"]["_allgather_base_"] + 1, counts
    assert counts["apart"]["_reduce_scatter_base_"] == counts["unit"]["_reduce_scatter_base_"] + 1, counts
