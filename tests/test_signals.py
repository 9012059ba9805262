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

    from shardlang.launch.workers import WorkerPool, context, in_fresh_process

    context()  # the server runs from here on, with this environment
    monkeypatch.setenv("SHARDLANG_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    expected = ("set after the server started", str(tmp_path), sys.path[:1], True)
    assert in_fresh_process(_seen, "SHARDLANG_TEST_MARK") == expected
    with WorkerPool(2, timeout_s=300) as pool:
        assert pool.run(_seen, "SHARDLANG_TEST_MARK") == [expected, expected]
    assert os.environ["SHARDLANG_TEST_MARK"]  # the launcher's own is untouched
