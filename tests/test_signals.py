"""time_limit bounds user code, but never cuts short torch importing itself (which would leave torch
half-imported for the rest of the process)."""

import time

import pytest

from shardlang.cli.signals import time_limit
from shardlang.cli.status import UsageError


def _find_and_load(name: str, seconds: float) -> str:
    """Stands for importlib's frame of the same name, importing `name` for `seconds`."""
    time.sleep(seconds)
    return name


def test_an_alarm_waits_for_torch_to_finish_importing():
    with time_limit(0.05, "the traced forward"):
        assert _find_and_load("torch.distributed.tensor", 0.3) == "torch.distributed.tensor"


def test_an_alarm_stops_user_code_and_other_imports():
    with pytest.raises(UsageError, match="the traced forward took longer than --timeout 0.05 s"):
        with time_limit(0.05, "the traced forward"):
            _find_and_load("my_model", 5.0)
    with pytest.raises(UsageError):
        with time_limit(0.05, "the traced forward"):
            time.sleep(5.0)


# --- workers: forked from a preloaded server, told what the launcher has --------------------------------


def _seen(name: str) -> tuple:
    import multiprocessing
    import os
    import sys

    return os.environ.get(name), os.getcwd(), sys.path[:1], multiprocessing.parent_process() is not None


@pytest.mark.distributed
def test_workers_and_fresh_processes_take_the_launchers_environment(monkeypatch, tmp_path):
    """A forkserver's child starts with the environment the server was started with: set after it (here,
    after the session's first pool started it), a variable still reaches every worker and fresh process,
    with the launcher's working directory and path."""
    import os
    import sys

    from shardlang.launch.servers import context
    from shardlang.launch.workers import WorkerPool, in_fresh_process

    context()  # the server runs from here on, with this environment
    monkeypatch.setenv("SHARDLANG_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    expected = ("set after the server started", str(tmp_path), sys.path[:1], True)
    assert in_fresh_process(_seen, "SHARDLANG_TEST_MARK") == expected
    with WorkerPool(2, timeout_s=300) as pool:
        assert pool.run(_seen, "SHARDLANG_TEST_MARK") == [expected, expected]
    assert os.environ["SHARDLANG_TEST_MARK"]  # the launcher's own is untouched


def _in_session(sid: int) -> list[int]:
    """The processes of session `sid` (a command started in a new session, and all it started)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.distributed
@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("fault", ["none", "raise"])
def test_the_command_returns_with_nothing_it_started_still_running(fault):
    """Issue 40: after apply (passing, or a rank that raises), no process the command started outlives it:
    its workers are joined and its forkserver, which otherwise tears torch down for seconds after its
    parent is gone, is stopped and reaped (on a GPU box a straggler still holds its device)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import ROOT

    model = "examples/mlp.py" if fault == "none" else "tests/faults/dies.py"
    env = {**os.environ, "SHARDLANG_TEST_FAULT": "raise"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardlang", "apply", "plans/mlp_tp.sl", model, "--nproc", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.wait(timeout=600) == (0 if fault == "none" else 2)
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for p in _in_session(proc.pid)}
    assert not left, left
