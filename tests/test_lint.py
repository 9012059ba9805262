"""Model-aware lint (SL200-SL210): each fixture plan against its model, through the CLI, with the
codes and positions of its `# expect:` lines; and lint at a world of 1024 in one process."""

import json
import re
import time
from pathlib import Path

import pytest
import torch

import shardlang
from shardlang.cli import main

from .conftest import FIXTURES, ROOT

LINT = sorted((FIXTURES / "lint").glob("*.sl"))


def _header(text: str, key: str) -> str | None:
    found = re.search(rf"^# {key}: (\S+)$", text, re.MULTILINE)
    return found.group(1) if found else None


@pytest.mark.parametrize("path", LINT, ids=lambda p: p.name)
def test_lint_fixture_reports_expected_codes(path: Path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = path.read_text()
    model = ["--entry", _header(text, "entry")] if _header(text, "entry") else [_header(text, "model")]
    status = main(["lint", str(path.relative_to(ROOT)), *model, "--world", _header(text, "world"), "--format", "json"])
    found = [(d["code"], d["line"], d["col"]) for d in json.loads(capsys.readouterr().out)]
    expected = [
        (c, int(line), int(col)) for c, line, col in re.findall(r"^# expect: (SL\d+) (\d+):(\d+)$", text, re.MULTILINE)
    ]
    assert expected, f"{path.name} has no expect lines"
    assert found == expected
    errors = any(code not in ("SL203", "SL206", "SL209", "SL210") for code, _, _ in found)
    assert status == (1 if errors else 0)


def test_lint_text_output_names_the_modules(capsys, monkeypatch, golden):
    monkeypatch.chdir(ROOT)
    status = main(["lint", "tests/fixtures/lint/sl201_two_rules.sl", "examples/llama.py", "--world", "4"])
    out, err = capsys.readouterr()
    golden(FIXTURES / "cli" / "lint_model_sl201.txt", f"exit: {status}\n--- stdout\n{out}--- stderr\n{err}")


def test_lint_with_model_needs_a_world_for_auto_dims(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["lint", "plans/llama_2d.sl", "examples/llama.py"]) == 2
    assert "give the world size with --world N" in capsys.readouterr().err


def test_lint_at_world_1024_in_one_process():
    """An 80-layer Llama structure on the meta device, linted at 1024 ranks (dp 128 x tp 8)."""
    import examples.llama as llama

    plan = shardlang.load(ROOT / "plans" / "llama_2d.sl", params={"tp": 8})
    with torch.device("meta"):
        model = llama.Transformer(vocab=32768, dim=4096, heads=32, layers=80, hidden=14336, seq=2048)
    start = time.perf_counter()
    found = plan.lint(model, world_size=1024)
    assert time.perf_counter() - start < 10
    assert [d.code for d in found] == []


HAS_TRANSFORMERS = __import__("importlib.util").util.find_spec("transformers") is not None


@pytest.mark.parametrize(
    ("plan", "model"),
    [
        ("init meta\n", "examples/encoder.py"),  # nn.MultiheadAttention initialises in _reset_parameters
        pytest.param(
            "init meta\n",
            "examples/hf_qwen3.py",
            marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs pip install -e '.[hf]'"),
        ),
        pytest.param(  # transformers' init_weights on the root initialises every module below it
            "init meta with init_weights\n",
            "examples/hf_qwen3.py",
            marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs pip install -e '.[hf]'"),
        ),
    ],
)
def test_init_meta_knows_the_models_own_initialisers(plan, model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "plan.sl"
    path.write_text("mesh world = cpu[dp=auto]\nfully_shard on world.dp { }\n" + plan)
    status = main(["lint", str(path), model, "--world", "2", "--format", "json"])
    assert status == 0 and json.loads(capsys.readouterr().out) == []
