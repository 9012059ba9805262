"""The command line: stdout, stderr and exit status pinned for text and JSON output."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlang.cli import main

from .conftest import FIXTURES, ROOT, shardlang_cli

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


def test_compile_prints_python_without_emit(capsys, monkeypatch):
    """`--emit python` is compile's only choice: the default, and still accepted."""
    monkeypatch.chdir(ROOT)
    assert main(["compile", "plans/mlp_tp.sl", "--emit", "python"]) == 0
    given = capsys.readouterr().out
    assert main(["compile", "plans/mlp_tp.sl"]) == 0
    assert given and capsys.readouterr().out == given


def _explain(*args: str) -> subprocess.CompletedProcess:
    return shardlang_cli("explain", *args)


FIXED_TP = """shardlang 1
mesh world = cpu[tp=2]
parallelize on world.tp {
    net1 : colwise
    net2 : rowwise
}
"""


@pytest.mark.distributed
def test_explain_takes_the_world_the_plan_fixes(tmp_path):
    """explain needs --world only where the meshes leave it open (an `auto` dim): as apply and compile do."""
    plan = tmp_path / "fixed.sl"
    plan.write_text(FIXED_TP)
    done = _explain(str(plan), "examples/mlp.py", "--no-step")
    assert done.returncode == 0, done.stderr
    assert "at world 2" in done.stdout, done.stdout
    auto = _explain("plans/mlp_tp.sl", "examples/mlp.py", "--no-step")
    assert auto.returncode == 2 and auto.stdout == "", auto.stdout
    assert "shardlang: error: mesh 'world' has an auto dim: give the world size with --world N" in auto.stderr


@pytest.mark.distributed
def test_explain_compare_without_the_step_compares_what_ranks_hold(tmp_path):
    """Without the step there is no peak, no bytes sent and no time: the comparison shows what rank R and the
    largest rank hold (it was a table of headers alone)."""
    plan = tmp_path / "fixed.sl"
    plan.write_text(FIXED_TP)
    done = _explain("plans/mlp_tp.sl", "examples/mlp.py", "--world", "2", "--no-step", "--compare", str(plan))
    assert done.returncode == 0, done.stderr
    compared = done.stdout.split(f"plans/mlp_tp.sl against {plan}", 1)[1]
    assert "drop --no-step" in compared
    for row in ("rank 0: parameters", "rank 0: gradients", "rank 0: optimizer states", "largest rank's total"):
        assert re.search(rf"{row} +│ +[\d.]+ [KMG]?i?B │ +[\d.]+ [KMG]?i?B │ +[+-][\d.]+ [KMG]?i?B │", compared), (
            compared
        )


HANGS = """
import time

import torch
import torch.nn as nn


class Hangs(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(600)  # lint's simulated step never ends
        return self.net(x)


def build_model():
    return Hangs()


def example_input(batch_size, generator):
    return torch.randn(batch_size, 4, generator=generator)
"""


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie no reaper collects counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_lint_leaves_no_process_behind_when_stopped(tmp_path):
    """lint's simulated step runs in a forked child: a lint stopped by SIGTERM (a scheduler, `timeout`) took
    its child with it only on a Ctrl-C from a terminal; the child ran on, alone, for as long as the step."""
    (tmp_path / "hangs.py").write_text(HANGS)
    (tmp_path / "plan.sl").write_text(
        "shardlang 1\nmesh world = cpu[dp=2]\nfully_shard on world.dp {\n    each net\n}\n"
    )
    command = [sys.executable, "-m", "shardlang", "lint", str(tmp_path / "plan.sl"), str(tmp_path / "hangs.py")]
    lint = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (children := _children(lint.pid)) and lint.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert children, lint.communicate(timeout=5) if lint.poll() is not None else "no child within 180 s"
        lint.send_signal(signal.SIGTERM)
        lint.wait(30)
        deadline = time.monotonic() + 10
        while any(map(_running, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, children)), f"still running after lint exited: {children}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lint.pid, signal.SIGKILL)  # whatever is left of its session, on any failure above
        lint.communicate()


@pytest.mark.distributed
def test_a_forked_step_is_killed_when_its_caller_is_stopped():
    """An exception in the parent while the forked child runs (a time limit's alarm, Ctrl-C) kills the child
    and leaves at once; it used to wait for the child to finish on its own."""
    from shardlang.runtime.simulated import in_fork

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    start = time.monotonic()
    try:
        with pytest.raises(Stop):
            in_fork(lambda: time.sleep(120), timeout_s=300)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < 20


@pytest.mark.distributed
def test_a_forked_child_computes_after_the_parent_used_its_thread_pool():
    """A child forked after the parent ran CPU ops on several threads does its own: the parent's OpenMP
    pool is not fork-safe, and SL223's forward in lint's child hung there for its whole time limit."""
    import torch

    from shardlang.runtime.simulated import in_fork

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        (x @ x).sum().item()  # the parent's pool has run
        status, value = in_fork(lambda: float((x @ x).sum()), timeout_s=30)
    finally:
        torch.set_num_threads(threads)
    assert status == "ok" and value == pytest.approx(float((x @ x).sum()), rel=1e-4)
