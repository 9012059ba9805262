"""The command line: stdout, stderr and exit status pinned for text and JSON output."""

import subprocess
import sys

import pytest

from shardlang.cli import main

from .conftest import FIXTURES, ROOT

CASES = {
    "lint_ok": ["lint", "plans/llama_2d.sl"],
    "lint_ok_world": ["lint", "plans/llama_2d.sl", "--world", "8", "-D", "tp=4"],
    "lint_ok_json": ["lint", "plans/mlp_tp.sl", "--format", "json"],
    "lint_world_mismatch": ["lint", "plans/llama_2d.sl", "--world", "6", "-D", "tp=4"],
    "lint_errors_text": ["lint", "tests/fixtures/invalid/sl101_names.sl"],
    "lint_errors_json": ["lint", "tests/fixtures/invalid/sl104_undefined.sl", "--format", "json"],
    "lint_syntax_error": ["lint", "tests/fixtures/invalid/sl100_several.sl"],
    "lint_unknown_param": ["lint", "plans/llama_2d.sl", "-D", "pt=4"],
    "lint_bad_define": ["lint", "plans/llama_2d.sl", "-D", "tp"],
    "lint_missing_file": ["lint", "plans/does_not_exist.sl"],
    "lint_model_ok": ["lint", "plans/llama_2d.sl", "examples/llama.py", "--world", "8"],
    "lint_model_missing": ["lint", "plans/llama_2d.sl", "examples/nope.py", "--world", "8"],
    "compile_model": ["compile", "plans/mlp_norm_2d.sl", "examples/mlp_norm.py", "--world", "4", "--emit", "python"],
    "compile_any_model": ["compile", "plans/mlp_tp.sl", "--emit", "python"],
    "compile_lint_error": ["compile", "plans/llama_2d.sl", "examples/mlp.py", "--world", "4", "--emit", "python"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CASES))
def test_cli_output_is_pinned(name, capsys, monkeypatch, golden):
    monkeypatch.chdir(ROOT)
    status = main(CASES[name])
    out, err = capsys.readouterr()
    golden(
        FIXTURES / "cli" / f"{name}.txt",
        f"$ shardlang {' '.join(CASES[name])}\nexit: {status}\n--- stdout\n{out}--- stderr\n{err}",
    )


def test_usage_error_exits_2(capsys):
    assert main(["lint"]) == 2  # argparse's exit is returned as a status: main never raises SystemExit
    assert "usage: shardlang lint" in capsys.readouterr().err


@pytest.mark.distributed
def test_python_dash_m_and_console_script_agree():
    """`python -m shardlang` is how torchrun starts it; the console script is how users do."""
    bad = str(FIXTURES / "invalid" / "sl107_mesh.sl")
    module = subprocess.run([sys.executable, "-m", "shardlang", "lint", bad], capture_output=True, text=True, cwd=ROOT)
    assert module.returncode == 2 and "error[SL107]" in module.stdout
    script = subprocess.run(["shardlang", "lint", bad], capture_output=True, text=True, cwd=ROOT)
    assert (script.returncode, script.stdout) == (module.returncode, module.stdout)


def test_the_wheel_lists_every_package():
    """pyproject names its packages one by one: a subpackage left out works installed editable and is
    missing from the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "shardlang").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


@pytest.mark.distributed
def test_library_verify_stays_a_function_after_the_checks_are_imported():
    """`shardlang.verify` is the library's function; importing the modules behind the checks (as
    explain does) must not replace it with a subpackage of the same name."""
    code = "import shardlang, shardlang.explain.simulate, shardlang.launch.job; assert callable(shardlang.verify), shardlang.verify"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
