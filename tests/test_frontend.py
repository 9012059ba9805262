"""The front end: valid plans against golden IR dumps, invalid plans against their `# expect:` codes,
the library entry points, params and world sizes."""

import re
from pathlib import Path

import pytest

import shardlang
from shardlang.frontend.diagnostics import render_text
from shardlang.frontend.ir import Shard, dump
from shardlang.frontend.source import MAX_PLAN_BYTES

from .conftest import FIXTURES, ROOT

VALID = sorted((FIXTURES / "valid").glob("*.sl"))
PLANS = sorted((ROOT / "plans").glob("*.sl"))
INVALID = sorted((FIXTURES / "invalid").glob("*.sl"))


@pytest.mark.parametrize("path", VALID + PLANS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_valid_plan_matches_golden_ir(path: Path, golden):
    plan = shardlang.load(path)
    assert not [d for d in plan.diagnostics if d.is_error]
    golden(FIXTURES / "golden" / f"{path.parent.name}__{path.stem}.ir.json", dump(plan))


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_plan_reports_expected_codes(path: Path):
    expected = re.findall(r"^# expect: (SL\d{3}) (\d+):(\d+)$", path.read_text(), re.MULTILINE)
    assert expected, f"{path.name} has no `# expect: SLxxx line:col` lines"
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.load(path)
    found = [(d.code, str(d.span.line), str(d.span.col)) for d in raised.value.diagnostics]
    assert found == [tuple(e) for e in expected]
    for d in raised.value.diagnostics:
        assert d.message and d.span.file == str(path)


def test_plan_error_renders_every_diagnostic_with_snippet():
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads("mesh world = cpu[dp=2]\nparallelize on world.dp { a : colwse }\ninit metaa\n", name="p.sl")
    text = str(raised.value)
    assert text == (
        "p.sl:2:31: error[SL104] undefined style 'colwse'\n"
        "   |\n"
        " 2 | parallelize on world.dp { a : colwse }\n"
        "   |                               ^^^^^^\n"
        "   = help: did you mean 'colwise' or 'rowwise'?\n"
        "\n"
        "p.sl:3:6: error[SL101] unknown init mode 'metaa'\n"
        "   |\n"
        " 3 | init metaa\n"
        "   |      ^^^^^\n"
        "   = help: did you mean 'meta'?\n"
        "\n"
        "2 errors"
    )


def test_params_override_and_world_size_resolve_auto():
    plan = shardlang.load(ROOT / "plans" / "llama_2d.sl", params={"tp": 4}, world_size=16)
    (mesh,) = plan.meshes
    assert mesh.shape(16) == (4, 4)
    assert plan.param("tp") == 4
    assert shardlang.load(ROOT / "plans" / "llama_2d.sl", params={"tp": "4"}).param("tp") == 4


def test_unknown_param_override_is_sl104_with_suggestion():
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.load(ROOT / "plans" / "llama_2d.sl", params={"pt": 4})
    (d,) = raised.value.diagnostics
    assert d.code == "SL104" and d.span is None and d.help == ("did you mean 'tp'?",)


def test_bad_param_value_is_reported_where_it_is_used():
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads("param tp = 2\nmesh world = cpu[dp=auto, tp=$tp]\n", params={"tp": "four"})
    (d,) = raised.value.diagnostics
    assert (d.code, d.span.line, d.span.col) == ("SL102", 2, 30)


@pytest.mark.parametrize(
    ("world", "ok"), [(4, True), (8, True), (6, True), (3, False), (1, False)], ids=lambda v: str(v)
)
def test_world_size_must_fit_the_mesh(world, ok):
    text = "mesh world = cpu[dp=auto, tp=2]\n"
    if ok:
        assert shardlang.loads(text, world_size=world).meshes[0].shape(world) == (world // 2, 2)
    else:
        with pytest.raises(shardlang.PlanError) as raised:
            shardlang.loads(text, world_size=world)
        assert [d.code for d in raised.value.diagnostics] == ["SL105"]


def test_fixed_mesh_must_equal_world_size():
    plan = shardlang.loads("mesh world = cuda[dp=2, tp=4]\n")
    assert plan.with_world(8) == []
    (d,) = plan.with_world(16)
    assert d.code == "SL105" and "8 ranks but the world has 16" in d.message


def test_keywords_are_names_where_no_keyword_is_expected():
    plan = shardlang.loads(
        "mesh mesh = cpu[replicate=1, on=2]\n"
        "parallelize on mesh.on { output : colwise(output=shard(-1)); mesh.each : rowwise }\n"
        "replicate on mesh.replicate { each init }\n"
    )
    rules = plan.parallelize[0].rules
    assert [str(r.target) for r in rules] == ["output", "mesh.each"]
    assert rules[0].style.get("output") == Shard(-1)
    assert str(plan.units[0].units[0].target) == "init"


def test_keywords_need_a_word_boundary():
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads("mesh world = cpu[tp=2]\nparallelize x onward.tp { }\n")
    assert [d.code for d in raised.value.diagnostics] == ["SL100"]


def test_unit_options_merge_block_then_unit():
    plan = shardlang.loads(
        "mesh world = cpu[dp=2]\n"
        "fully_shard on world.dp {\n"
        "  each a (reshard_after_forward=false)\n"
        "  each b\n"
        "  reshard_after_forward = true\n"
        "  offload = cpu\n"
        "  root = false\n"
        "}\n"
    )
    (block,) = plan.units
    a, b = block.units
    assert a.get("reshard_after_forward") is False and a.get("offload") == "cpu"
    assert b.get("reshard_after_forward") is True
    assert block.root is False


def test_default_checks_are_all_six():
    plan = shardlang.loads("mesh world = cpu[dp=2]\n")
    assert [c.name for c in plan.checks] == ["gradients", "init", "module_states", "init_device", "placements", "comms"]
    assert plan.init.mode == "auto"


def test_file_over_one_mib_is_sl102(tmp_path):
    path = tmp_path / "huge.sl"
    path.write_bytes(b"# padding\n" * (MAX_PLAN_BYTES // 10 + 1))
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.load(path)
    (d,) = raised.value.diagnostics
    assert d.code == "SL102" and "1 MiB" in d.message


def test_non_utf8_file_is_sl102_at_the_bad_byte(tmp_path):
    path = tmp_path / "latin1.sl"
    path.write_bytes(b"mesh world = cpu[dp=2]\n# caf\xe9\n")
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.load(path)
    (d,) = raised.value.diagnostics
    assert (d.code, d.span.line, d.span.col) == ("SL102", 2, 6)
    assert "0xe9" in render_text(d)


def test_syntax_errors_are_capped_and_never_repeat():
    text = "".join(f"mesh m{i} = cpu[=]\n" for i in range(30))
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads(text)
    lines = [d.span.line for d in raised.value.diagnostics]
    assert lines == list(range(1, 11))


def test_a_misspelt_diagnostic_code_fails_where_it_is_written():
    """Codes are constants imported by name (a typo fails at import); a code given as text must be in the table."""
    import shardlang.frontend.diagnostics as diagnostics

    with pytest.raises(ImportError):
        exec("from shardlang.frontend.diagnostics import SL2O1", {})
    with pytest.raises(ValueError):
        diagnostics.Diagnostic("SL999", "no such code")
    assert diagnostics.Diagnostic(diagnostics.SL201, "x").code == "SL201"
    assert set(diagnostics.CODES) == {code.name for code in diagnostics.Code}


@pytest.mark.parametrize(
    "text, line, col",
    [
        ("mesh world = cpu[dp=2]\nparam tp = 1{zeros}\n", 2, 12),
        ("shardlang 1{zeros}\nmesh world = cpu[dp=2]\n", 1, 11),
        ("mesh world = cpu[dp=1{zeros}]\n", 1, 21),
    ],
    ids=["param", "version", "mesh"],
)
def test_a_number_of_thousands_of_digits_is_sl102_at_it(text, line, col):
    """Python's int() refuses text of over 4,300 digits (ValueError, a traceback): the plan's number is SL102."""
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads(text.format(zeros="0" * 5000))
    (d,) = raised.value.diagnostics
    assert (d.code, d.span.line, d.span.col) == ("SL102", line, col), d
    assert "5,001 digits" in d.message


#: Each thing SL103 finds given twice, with the message and help it has said since before one helper wrote
#: them all (issue 40; the pipeline's help said "the first split is at line 2" before).
GIVEN_TWICE = [
    ("param tp = 2\nparam tp = 4\nmesh world = cpu[dp=2]\n", "param 'tp' is declared twice", 1),
    ("mesh world = cpu[dp=2]\nmesh world = cpu[dp=4]\n", "mesh 'world' is declared twice", 1),
    ("mesh world = cpu[dp=2, dp=2]\n", "mesh dim 'dp' is declared twice in mesh 'world'", None),
    ("use a.b.C as c\nuse a.b.D as c\nmesh world = cpu[dp=2]\n", "'c' is declared twice by use", 1),
    ("mesh world = cpu[dp=2]\ninit meta\ninit cpu\n", "init is given twice", 2),
    ("mesh world = cpu[dp=2]\nverify placements, comms, placements\n", "check 'placements' is listed twice", 2),
    (
        "mesh world = cpu[tp=2]\nparallelize on world.tp { a : colwise(output=replicate, output=replicate) }\n",
        "argument 'output' is given twice",
        2,
    ),
    (
        "mesh world = cpu[dp=2]\nfully_shard on world.dp { reshard_after_forward = true; reshard_after_forward = false }\n",
        "option 'reshard_after_forward' is set twice",
        2,
    ),
    (
        "mesh world = cpu[pp=2]\npipeline on world.pp { split before layers.1; split before layers.2; schedule = gpipe }\n",
        "the pipeline is split twice",
        2,
    ),
]


@pytest.mark.parametrize(("text", "message", "first"), GIVEN_TWICE, ids=[m for _, m, _ in GIVEN_TWICE])
def test_sl103_says_what_is_given_twice_and_where_the_first_is(text, message, first):
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.loads(text)
    (found,) = [d for d in raised.value.diagnostics if d.code == "SL103"]
    assert found.message == message
    assert found.help == ((f"the first is at line {first}",) if first is not None else ())
