"""Hostile input, dying processes and slow machines (issue 13): each case exits with the status the
README's table gives, prints one clear message and no traceback, and leaves no process behind.

In-process cases call `main([...])`; those that start workers run `python -m shardlang` and watch the
process tree through /proc (every descendant seen while it ran must be gone afterwards). The commands
that start workers run concurrently, a few at a time, so that the file stays near two minutes on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardlang.cli import main
from shardlang.compiler import torchlimits
from shardlang.frontend.diagnostics import did_you_mean

from .conftest import FIXTURES, ROOT
from .test_apply_cli import one_object

HOSTILE = FIXTURES / "hostile"
H = "tests/fixtures/hostile"


# --- helpers ---------------------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The /proc state letter of `pid`, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def descendants(root: int) -> set[int]:
    """Every process below `root`, walked down from it through /proc/PID/task/TID/children (Linux): a
    scan of every process's stat, ten times a second in four runs at once, cost a core's worth of system
    time on a box where other jobs keep a thousand processes."""
    found, frontier = set(), [root]
    while frontier:
        pid = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    children = {int(c) for c in f.read().split()} - found
            except (OSError, ValueError):
                continue
            found |= children
            frontier.extend(children)
    return found


class Run:
    """`python -m shardlang ARGS` in its own session, its descendants watched; optionally a signal sent to
    it once every worker has reached the hanging forward of forward_hangs.py (an event, not a wait: start-up
    takes seconds on an idle machine and much longer on a busy one)."""

    def __init__(self, *args: str, send: signal.Signals | None = None, to_group=False, timeout=600):
        self.args = args
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        hanging = None
        if send is not None:
            hanging = Path(tempfile.mkdtemp(prefix="shardlang-hanging-"))
            env["SHARDLANG_TEST_HANGING"] = str(hanging)
            nproc = int(args[args.index("--nproc") + 1])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardlang", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
            text=True,
        )
        self.seen: set[int] = set()
        start = time.monotonic()
        signalled = None
        while self.proc.poll() is None and time.monotonic() - start < timeout:
            self.seen |= descendants(self.proc.pid)
            if hanging is not None and signalled is None and len(list(hanging.iterdir())) == nproc:
                self.seen |= descendants(self.proc.pid)  # every worker is in the forward: all of them seen
                if to_group:
                    os.killpg(self.proc.pid, send)
                else:
                    self.proc.send_signal(send)
                signalled = time.monotonic()
            time.sleep(0.1)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.stdout, self.stderr = self.proc.communicate()
        self.status = self.proc.returncode
        self.seconds_after_signal = None if signalled is None else time.monotonic() - signalled
        deadline = time.monotonic() + 60  # waited for only while some are still alive
        while any(alive(p) for p in self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.left = sorted(p for p in self.seen if alive(p))
        if hanging is not None:
            shutil.rmtree(hanging, ignore_errors=True)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __repr__(self) -> str:
        return f"shardlang {' '.join(self.args)}: exit {self.status}\n{self.output}"


class Local:
    """`shardlang ARGS` run in this process (tests/conftest.py: shardlang_cli), with what Run records: its
    workers are children of this process's forkserver, and every one of them that the command started must
    be gone afterwards."""

    def __init__(self, *args: str):
        from multiprocessing import forkserver

        from .conftest import shardlang_cli, start_forkserver

        self.args = args
        start_forkserver()
        server = forkserver._forkserver._forkserver_pid
        before = descendants(server)
        done = shardlang_cli(*args)
        self.seen = descendants(server) - before
        self.status, self.stdout, self.stderr = done.returncode, done.stdout, done.stderr
        deadline = time.monotonic() + 60
        while any(alive(p) for p in descendants(server) - before) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.left = sorted(p for p in descendants(server) - before if alive(p))

    output = Run.output
    __repr__ = Run.__repr__


def assert_clean(run: Run | Local, status: int) -> None:
    assert run.status == status, run
    assert "Traceback" not in run.output, run
    assert not run.left, f"processes left behind: {run.left}\n{run}"


def call(args: list[str], capsys) -> tuple[int, str]:
    status = main(args)
    out, err = capsys.readouterr()
    return status, out + err


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert lines[0].startswith("shardlang: error: ") or ": error: argument" in lines[0], text
    return lines[0]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# --- output files and numeric flags: usage errors, exit 2 ---------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["compile", "plans/mlp_tp.sl", "--emit", "python", "-o", "missing/dir/x.py"],
        ["compile", "plans/mlp_tp.sl", "--emit", "python", "-o", "plans"],
        ["explain", "plans/mlp_tp.sl", "examples/mlp.py", "--world", "2", "-o", "missing/dir/x.txt"],
        ["explain", "plans/mlp_tp.sl", "examples/mlp.py", "--world", "2", "-o", "plans"],
    ],
    ids=["compile-missing-dir", "compile-dir", "explain-missing-dir", "explain-dir"],
)
def test_output_that_cannot_be_written_is_a_usage_error(args, capsys):
    status, text = call(args, capsys)
    assert status == 2
    assert "cannot write" in one_error_line(text)


@pytest.mark.parametrize(
    "args",
    [
        ["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--timeout", "nan"],
        ["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--timeout", "-5"],
        ["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--timeout", "inf"],
        ["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--seed", str(2**70)],
        ["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--seed", "2**70"],
        ["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "0"],
        ["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--steps", "0"],
        ["lint", "plans/mlp_tp.sl", "--world", "-1"],
        ["lint", "plans/mlp_tp.sl", "--world", str(2**40)],
        ["compile", "plans/mlp_tp.sl", "--world", "x", "--emit", "python"],
        ["explain", "plans/mlp_tp.sl", "examples/mlp.py", "--world", "2", "--rank", "-1"],
        ["explain", "plans/mlp_tp.sl", "examples/mlp.py", "--world", "2", "--timeout", "0"],
    ],
    ids=lambda a: " ".join(a[3:]),
)
def test_numeric_flags_are_checked_when_parsed(args, capsys):
    status, text = call(args, capsys)
    assert status == 2
    assert "usage: shardlang" in text and "Traceback" not in text
    assert sum(": error: " in line for line in text.splitlines()) == 1


def test_seed_takes_what_torch_manual_seed_takes():
    import torch

    from shardlang.cli.arguments import SEEDS

    torch.manual_seed(SEEDS.start)
    torch.manual_seed(SEEDS.stop - 1)
    with pytest.raises((ValueError, RuntimeError)):
        torch.manual_seed(SEEDS.stop)


# --- suspected: /dev/zero and long names ---------------------------------------------------------------


def test_lint_dev_zero_reads_at_most_a_mebibyte(capsys):
    start = time.perf_counter()
    status, text = call(["lint", "/dev/zero"], capsys)
    assert status == 2 and "SL102" in text and "over 1,048,576 bytes" in text
    assert time.perf_counter() - start < 60  # reading /dev/zero to its end never returns


def test_did_you_mean_on_30000_character_names_is_fast():
    long = "x" * 30_000
    start = time.perf_counter()
    assert did_you_mean(long, [long[:-1] + "y", "colwise"]) == ()
    assert did_you_mean("colwse", ["colwise", "y" * 30_000]) == ("did you mean 'colwise'?",)
    assert time.perf_counter() - start < 30  # milliseconds; a 30000 x 30000 edit distance takes minutes


def test_a_plan_with_a_30000_character_name(tmp_path, capsys):
    plan = tmp_path / "long.sl"
    plan.write_text(f"mesh world = cpu[tp=2]\nparallelize on world.tp {{ net1 : {'c' * 30_000} }}\n")
    start = time.perf_counter()
    status, text = call(["lint", str(plan)], capsys)
    assert status == 2 and "SL104" in text and "Traceback" not in text
    assert time.perf_counter() - start < 60  # well under a second idle: only a blow-up reaches it


# --- broken model files in the launcher (lint, explain, apply before any worker) ------------------------


@pytest.mark.parametrize(
    "command, model, message",
    [
        ("lint", "sys_exit.py", "called sys.exit(3)"),
        ("explain", "sys_exit.py", "called sys.exit(3)"),
        ("apply", "sys_exit.py", "called sys.exit(3)"),
        ("explain", "not_module.py", "returned a str, not a torch.nn.Module"),
        ("lint", "not_module.py", "returned a str, not a torch.nn.Module"),
        ("apply", "no_params.py", "a model without parameters"),
    ],
)
def test_broken_model_file_in_the_launcher(command, model, message, capsys):
    args = [command, "plans/mlp_tp.sl", f"{H}/{model}"] + {
        "lint": ["--world", "2"],
        "explain": ["--world", "2"],
        "apply": ["--nproc", "2"],
    }[command]
    status, text = call(args, capsys)
    assert status == 2
    assert message in one_error_line(text)


@pytest.mark.distributed
def test_os_exit_at_import_does_not_end_the_command():
    """A subprocess: were the guard to fail, os._exit would end this test process."""
    run = Run("lint", "plans/mlp_tp.sl", f"{H}/os_exit.py", "--world", "2")
    assert_clean(run, 2)
    assert "called os._exit(5)" in one_error_line(run.stderr)


def test_model_file_that_hangs_at_import_is_bounded_by_apply_timeout(capsys):
    start = time.perf_counter()
    status, text = call(["apply", "plans/mlp_tp.sl", f"{H}/hang.py", "--nproc", "2", "--timeout", "2"], capsys)
    assert status == 2
    assert "took longer than --timeout 2 s" in one_error_line(text)
    assert time.perf_counter() - start < 120  # the import hangs for ever: any bound shows --timeout acted


@pytest.mark.distributed
def test_explain_of_a_forward_that_hangs_is_bounded_by_its_timeout(capsys):
    start = time.perf_counter()
    args = ["explain", "plans/mlp_tp.sl", f"{H}/forward_hangs.py", "--world", "2", "--timeout", "3"]
    status, text = call(args, capsys)
    assert status == 2
    assert "took longer than --timeout 3 s" in one_error_line(text)
    assert time.perf_counter() - start < 120  # the forward hangs for ever: any bound shows --timeout acted


# --- uneven shards: SL203 names the right statement and sizes; SL301 where torch cannot run one ---------


@pytest.mark.distributed
def test_sl203_blames_fsdp_with_the_real_sizes(capsys):
    status, text = call(["lint", "plans/llama_2d.sl", "examples/llama.py", "--world", "6"], capsys)
    assert status == 0
    assert "plans/llama_2d.sl:17" not in text  # the colwise line: tp=2 splits 32 rows evenly
    assert "plans/llama_2d.sl:28:5: warning[SL203]" in text  # `each layers.*`: FSDP's split
    assert "layers.0.attention.wq.weight dim 0: 16 (32 split by tp=2) over dp=3" in text
    assert "11 over tp=2" not in text


@pytest.mark.distributed  # apply starts its workers' forkserver while it lints (cli.launcher.prepare_workers)
def test_uneven_rowwise_is_an_error_where_torch_cannot_run_it(capsys):
    status, text = call(["lint", "plans/mlp_tp.sl", "examples/mlp.py", "--world", "3"], capsys)
    assert status == 1
    assert "plans/mlp_tp.sl:10:5: error[SL301]" in text and "'net2' has 32" in text
    status, text = call(["apply", "plans/mlp_tp.sl", "examples/mlp.py", "--nproc", "3"], capsys)
    assert status == 2 and "error[SL301]" in text and "Traceback" not in text


@pytest.mark.distributed
def test_torch_limits_match_the_installed_torch(pools):
    """The cases of compiler/torchlimits.py, run on gloo: the table says what this torch cannot run."""
    from .hostile_jobs import uneven_tp_cases

    runs = pools(3).run(uneven_tp_cases)[0]
    cannot = torchlimits.cannot(torchlimits.ROWWISE_UNEVEN_LOCAL_INPUT)
    assert runs["rowwise_uneven_local_input"] is not cannot, runs
    assert all(ok for name, ok in runs.items() if name != "rowwise_uneven_local_input"), runs


def test_torch_limits_table_by_release():
    assert torchlimits.cannot(torchlimits.ROWWISE_UNEVEN_LOCAL_INPUT, "2.13.0+cpu")
    assert torchlimits.limits("2.99.1") == torchlimits.LIMITS[max(torchlimits.LIMITS)]
    assert torchlimits.limits("2.0.0") == torchlimits.LIMITS[min(torchlimits.LIMITS)]


# --- commands that start workers ----------------------------------------------------------------------

APPLY = ("apply", "plans/mlp_tp.sl")
HANGS = (*APPLY, f"{H}/forward_hangs.py", "--nproc", "2")
# Run in this process: what the command prints and its exit status. The broken inputs and losses fail alike
# on every rank: one rank shows it.
LOCAL = {
    "forward_rank1": (*APPLY, f"{H}/forward_rank1.py", "--nproc", "2"),
    "forward_rank1_debug": (*APPLY, f"{H}/forward_rank1.py", "--nproc", "2", "--debug"),
    "input_wrong_shape": (*APPLY, f"{H}/input_wrong_shape.py", "--nproc", "1"),
    "input_wrong_type": (*APPLY, f"{H}/input_wrong_type.py", "--nproc", "1"),
    "input_raises": (*APPLY, f"{H}/input_raises.py", "--nproc", "1"),
    "loss_vector": (*APPLY, f"{H}/loss_vector.py", "--nproc", "1"),
    "loss_raises": (*APPLY, f"{H}/loss_raises.py", "--nproc", "1"),
    "os_exit_worker": (*APPLY, f"{H}/os_exit_worker.py", "--nproc", "2"),
}
# Run as processes: signals sent to the command, and a start-up that must be slower than its time limit (a
# warm forkserver's workers may start within 0.2 s).
RUNS = {
    # --json: main prints the same one line on stderr with it, and the JSON tests below read these runs too
    "startup_timeout": lambda: Run(*APPLY, "examples/mlp.py", "--nproc", "2", "--timeout", "0.2", "--json"),
    "ctrl_c": lambda: Run(*HANGS, "--json", send=signal.SIGINT, to_group=True),
    "sigterm": lambda: Run(*HANGS, "--json", send=signal.SIGTERM),
    "sigkill": lambda: Run(*APPLY, f"{H}/forward_hangs.py", "--nproc", "2", send=signal.SIGKILL),
}


@pytest.fixture(scope="module")
def runs():
    """Every worker-starting command of this file: the processes side by side (the three that wait for a
    hang to send a signal mostly sleep), the commands run in this process meanwhile, one after another."""
    with ThreadPoolExecutor(len(RUNS)) as pool:
        futures = {name: pool.submit(make) for name, make in RUNS.items()}
        done = {name: Local(*args) for name, args in LOCAL.items()}
        return {**done, **{name: future.result() for name, future in futures.items()}}


@pytest.mark.distributed
def test_forward_raising_on_rank_1_is_sl400_with_the_users_frame(runs):
    run = runs["forward_rank1"]
    assert_clean(run, 1)
    assert "error[SL400] check comms raised on rank 1: RuntimeError: forward failed on rank 1 only" in run.stderr
    assert f"at {H}/forward_rank1.py:8 in forward" in run.stderr
    assert "site-packages" not in run.output and "shardlang/" not in run.output


@pytest.mark.distributed
def test_debug_adds_the_full_traceback(runs):
    run = runs["forward_rank1_debug"]
    assert run.status == 1 and not run.left, run
    assert "Traceback" in run.stderr and "torch" in run.stderr


@pytest.mark.distributed
def test_example_input_of_the_wrong_shape_is_sl400_at_the_check(runs):
    run = runs["input_wrong_shape"]
    assert_clean(run, 1)
    assert "error[SL400]" in run.stderr and "a and b must have same reduction dim" in run.stderr
    assert f"at {H}/_base.py:15 in forward" in run.stderr


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name, message",
    [
        ("input_wrong_type", "returned a str: the model's inputs must be a tensor or a tuple of them"),
        ("input_raises", "failed: ValueError: no data here"),
        ("loss_vector", "returned a tensor of shape (2,), not a scalar tensor"),
        ("loss_raises", "failed: ArithmeticError: the loss is broken"),
    ],
)
def test_broken_example_input_or_loss_is_one_line_and_exit_2(runs, name, message):
    run = runs[name]
    assert_clean(run, 2)
    first = run.stderr.splitlines()[0]
    assert first.startswith("shardlang: error: rank ") and message in first, run
    assert "site-packages" not in run.output


@pytest.mark.distributed
def test_os_exit_in_a_worker_is_a_dead_rank(runs):
    run = runs["os_exit_worker"]
    assert_clean(run, 2)
    assert "died: worker exited with code 5" in one_error_line(run.stderr)


@pytest.mark.distributed
def test_startup_timeout_follows_timeout_and_names_the_ranks(runs):
    run = runs["startup_timeout"]
    assert_clean(run, 2)
    line = one_error_line(run.stderr)
    assert "start-up timed out after 0.2 s: ranks 0, 1 of 2 never reported" in line


@pytest.mark.distributed
def test_ctrl_c_exits_130_with_one_line_and_no_process_left(runs):
    run = runs["ctrl_c"]
    assert_clean(run, 130)
    assert run.stderr.strip().splitlines() == ["shardlang: interrupted (Ctrl-C); no worker is left running"], run
    assert len(run.seen) >= 2  # the workers were running when it came


@pytest.mark.distributed
def test_sigterm_is_forwarded_exits_143_with_one_line(runs):
    run = runs["sigterm"]
    assert_clean(run, 143)
    assert run.stderr.strip().splitlines() == ["shardlang: stopped by SIGTERM; no worker is left running"], run
    assert run.seconds_after_signal < 60  # forwarded, not waited out (the forward hangs for ever)


@pytest.mark.distributed
def test_json_when_the_workers_do_not_start_in_time(runs):
    run = runs["startup_timeout"]
    report = one_object(run.stdout)
    assert report["exit_status"] == 2 and report["failure"]["kind"] == "startup"
    assert "start-up timed out after 0.2 s" in report["failure"]["message"]
    assert report["world_size"] == 2 and report["device"] == "cpu (gloo)"
    assert {r["state"] for r in report["ranks"]} <= {"starting", "done"}


@pytest.mark.distributed
@pytest.mark.parametrize("name, status, kind", [("ctrl_c", 130, "interrupted"), ("sigterm", 143, "terminated")])
def test_json_when_interrupted_says_what_each_rank_was_doing(runs, name, status, kind):
    run = runs[name]
    assert_clean(run, status)
    report = one_object(run.stdout)
    assert report["exit_status"] == status and report["failure"]["kind"] == kind, report
    # The signal comes once every worker runs the hanging forward (Run waits for that)
    assert [r["rank"] for r in report["ranks"]] == [0, 1], report
    for rank in report["ranks"]:
        assert rank["state"] == "running", rank
        said = ("running its job", "loading the model file", "building the model", "applying the plan", "check ")
        assert rank["said"].startswith(said), rank
    assert len(run.stderr.strip().splitlines()) == 1  # main's one line, as without --json


@pytest.mark.distributed
def test_workers_die_with_a_killed_launcher(runs):
    run = runs["sigkill"]
    assert run.status == -signal.SIGKILL
    assert len(run.seen) >= 2 and not run.left, run  # left: still alive 60 s after the launcher's exit
    assert "Traceback" not in run.output


# --- the README ---------------------------------------------------------------------------------------


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_set_up_says_how_to_get_the_cpu_build_first():
    block = _readme().split("## Set up", 1)[1].split("```\n", 2)[1]
    lines = block.splitlines()
    install = next(i for i, line in enumerate(lines) if line.startswith("pip install -e . "))
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in lines[install - 1]
    assert lines[install - 1].startswith("#")  # a note, not a third command
    commands = [line for line in _readme().split("## A plan", 1)[0].splitlines() if line.startswith("pip install")]
    assert len(commands) == 2, commands


def test_readme_bad_plan_is_what_lint_prints(capsys):
    text = _readme()
    shown = text.split("$ shardlang lint plans/broken/bad.sl\n", 1)[1].split("```", 1)[0]
    status, out = call(["lint", "plans/broken/bad.sl"], capsys)
    assert status == 2 and out == shown
    assert 'shardlang.load("plans/broken/bad.sl")' in text


def test_readme_with_world_examples_are_true():
    import shardlang

    plan = shardlang.load(ROOT / "plans" / "llama_2d.sl", params={"tp": 4}, world_size=16)
    assert plan.with_world(12) == [] and "print(plan.with_world(12))          # []" in _readme()
    assert [d.code for d in plan.with_world(10)] == ["SL105"]


def test_readme_library_verify_is_under_the_main_guard():
    library = _readme().split("## Library", 1)[1]
    guard = library.index('if __name__ == "__main__":')
    assert guard < library.index("shardlang.verify(plan, build_model, example_input, nproc=4)")


@pytest.mark.distributed
def test_explain_lays_out_what_torch_cannot_run_and_notes_the_step(capsys):
    status, text = call(["explain", "plans/mlp_tp.sl", "examples/mlp.py", "--world", "3"], capsys)
    assert status == 0, text
    assert "note: no collectives: a training step fails at this world size" in text
