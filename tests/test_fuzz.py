"""Bad input never escapes as a traceback: random text and mutated example plans either parse into a
plan or raise PlanError with at least one well-formed, renderable diagnostic."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardlang
from shardlang.frontend.diagnostics import CODES, render_all, render_json
from shardlang.frontend.source import MAX_PLAN_BYTES

from .conftest import FIXTURES, ROOT

SEEDS = [p.read_text() for p in sorted((ROOT / "plans").glob("*.sl")) + sorted((FIXTURES / "valid").glob("*.sl"))]
TOKEN = re.compile(r"\s+|[A-Za-z_][A-Za-z0-9_]*|-?\d+(?:\.\d+)?|\S")
FUZZ = settings(
    max_examples=int(__import__("os").environ.get("SHARDLANG_FUZZ_EXAMPLES", 150)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def assert_only_plan_or_plan_error(text: str = None, *, path=None) -> None:
    try:
        plan = shardlang.load(path) if path is not None else shardlang.loads(text, name="fuzz.sl")
    except shardlang.PlanError as e:
        assert e.diagnostics, "PlanError without diagnostics"
        lines = (text or "").count("\n") + 1
        for d in e.diagnostics:
            assert d.code in CODES and d.message
            if d.span is not None and text is not None:
                assert 1 <= d.span.line <= lines and d.span.col >= 1
        render_all(e.diagnostics, e.sources)
        json.loads(render_json(e.diagnostics))
    else:
        assert isinstance(plan, shardlang.Plan)


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


@st.composite
def mutated_plans(draw) -> str:
    parts = tokens(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        if not parts:
            break
        i = draw(st.integers(0, len(parts) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "truncate", "insert", "replace"]))
        if op == "delete":
            del parts[i]
        elif op == "duplicate":
            parts.insert(i, parts[i])
        elif op == "swap":
            j = draw(st.integers(0, len(parts) - 1))
            parts[i], parts[j] = parts[j], parts[i]
        elif op == "truncate":
            parts = parts[:i]
        elif op == "insert":
            parts.insert(
                i,
                draw(
                    st.sampled_from(
                        [
                            "{",
                            "}",
                            "(",
                            ")",
                            "[",
                            "]",
                            ",",
                            ";",
                            ":",
                            "=",
                            "$",
                            ".",
                            "*",
                            "**",
                            '"',
                            "#",
                            "\n",
                            "-1",
                            "1e9",
                            "on",
                            "each",
                            "root",
                            "class",
                            "mesh",
                            "\x00",
                            "é",
                        ]
                    )
                ),
            )
        else:
            parts[i] = draw(st.text(max_size=6))
    return "".join(parts)


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text):
    assert_only_plan_or_plan_error(text)


@FUZZ
@given(mutated_plans())
def test_mutated_example_plans(text):
    assert_only_plan_or_plan_error(text)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bytes") / "plan.sl"
    path.write_bytes(data)
    assert_only_plan_or_plan_error(path=path)


@pytest.mark.parametrize("opener,closer", [("(", ")"), ("{", "}"), ("[", "]")])
@pytest.mark.parametrize("depth", [50, 5000])
def test_deep_nesting(opener, closer, depth):
    assert_only_plan_or_plan_error(
        f"mesh world = cpu[tp=2]\nparallelize on world.tp {{ a : colwise(input={opener * depth}shard(1){closer * depth}) }}\n"
    )
    assert_only_plan_or_plan_error(opener * depth + closer * depth)


def test_file_just_under_and_over_the_limit(tmp_path):
    # Rules, then comment lines up to the limit: the size is the subject here; parse_bench times big plans.
    body = "mesh world = cpu[tp=2]\nparallelize on world.tp {\n" + "    layers.0.attention.wq : colwise\n" * 100
    filler = "    # " + "x" * 73 + "\n"
    under = body + filler * ((MAX_PLAN_BYTES - len(body) - 2) // len(filler)) + "}\n"
    assert len(under.encode()) <= MAX_PLAN_BYTES
    (tmp_path / "under.sl").write_text(under)
    assert shardlang.load(tmp_path / "under.sl").parallelize
    (tmp_path / "over.sl").write_text(under + "#" * 64)
    with pytest.raises(shardlang.PlanError) as raised:
        shardlang.load(tmp_path / "over.sl")
    assert [d.code for d in raised.value.diagnostics] == ["SL102"]
