"""Shared test options: `--update-goldens` rewrites expected-output files instead of comparing with them."""

import contextlib
import io
import os
import subprocess
import threading
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parent.parent


def pytest_configure(config):
    """Ctrl-C delivered, whoever started the suite: bash without job control starts a background command
    (`pytest ... &` in a script) with SIGINT ignored, which every command a test starts would inherit
    across exec, and then the tests that send a command Ctrl-C would wait for an exit that never comes."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session):
    """Every object alive once the tests are collected (torch, transformers, the test modules) moved out of
    the collector's reach: they live for the whole session, and walking them again at every full
    collection cost the fast lane about 7 s of its 45 (Python's `gc.freeze`)."""
    import gc

    gc.freeze()


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", help="rewrite golden files from the current output")


@pytest.fixture
def golden(request):
    """Compare text with a golden file, or (with --update-goldens) write it."""
    update = request.config.getoption("--update-goldens")

    def check(path: Path, actual: str) -> None:
        if update or not path.exists():
            path.write_text(actual, encoding="utf-8")
            if not update:
                pytest.fail(f"golden file {path.name} was missing and has been written; check it and run again")
            return
        assert actual == path.read_text(encoding="utf-8"), (
            f"output differs from {path}; rerun with --update-goldens if intended"
        )

    return check


class Pools:
    """One worker pool per world size for the whole session (spawning a gloo world costs seconds);
    a pool stopped by a failing job is replaced on next use, and so is one whose workers hold many
    descriptors. Each job's meshes make gloo groups that stay open (about ten descriptors a rank for a
    2-D mesh): `shardlang apply` runs one job per pool, but the suite runs hundreds in these."""

    MAX_DESCRIPTORS = 512

    def __init__(self):
        self._pools = {}
        self._closing = []  # threads closing retired pools while the tests go on

    def __call__(self, world_size: int):
        from shardlang.launch.workers import WorkerPool

        start_forkserver()
        pool = self._pools.get(world_size)
        if pool is not None and not pool.broken and _most_descriptors(pool) > self.MAX_DESCRIPTORS:
            closing = threading.Thread(target=pool.close, daemon=True)
            closing.start()
            self._closing.append(closing)
            pool = None
        if pool is None or pool.broken:
            pool = self._pools[world_size] = WorkerPool(world_size, timeout_s=600)
        return pool

    def close(self):
        """Every pool at once: each waits for its workers to tear down their process group (seconds), and
        one after another that was the last test's teardown time."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(self._pools))) as closing:
            list(closing.map(lambda pool: pool.close(), self._pools.values()))
        for closing in self._closing:
            closing.join()


def _most_descriptors(pool) -> int:
    """The most descriptors any worker of `pool` holds open (0 where /proc does not say)."""
    counts = [0]
    for pid in pool.pids:
        with contextlib.suppress(OSError):
            counts.append(len(os.listdir(f"/proc/{pid}/fd")))
    return max(counts)


def start_forkserver() -> None:
    """The forkserver every worker of this session forks from, preloaded with transformers where it is
    installed: a worker that imports it itself spends 2-3 s of a core on it, and most jobs build
    transformers models."""
    import importlib.util

    from shardlang.launch.servers import start_forkserver

    start_forkserver(("transformers",) if importlib.util.find_spec("transformers") else ())


def shardlang_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, workers: bool = True
) -> subprocess.CompletedProcess:
    """`shardlang ARGS` run in this process, as `python -m shardlang` would run it from `cwd` with `env` added
    to the environment: its exit status and what it printed. Its workers fork from this process's
    forkserver, which stays up between commands (a command in a fresh interpreter spends 5-6 s importing
    torch twice, in itself and in its forkserver); `workers=False` for a command that starts none (lint
    --no-step), which then starts no process at all and may run in the fast lane. The environment and
    working directory are restored afterwards; the tests that need the real process (signals, the process
    tree, torchrun, the console script, code that exits the interpreter) start one."""
    from shardlang.cli.main import main

    if workers:
        start_forkserver()
    out, err = io.StringIO(), io.StringIO()
    saved, here = dict(os.environ), Path.cwd()
    try:
        os.environ.update(env or {})
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main([str(a) for a in args])
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["shardlang", *args], status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def pools():
    pools = Pools()
    yield pools
    pools.close()


# --- the fast lane's guard ------------------------------------------------------------------------------
#
# `python -m pytest -m "not distributed"` is the fast lane: no process group (gloo or fake) and no process.
# A test not marked `distributed` that starts either fails, naming what it started, even where the code
# under test catches the error (explain's forked child, a worker pool's start).


class StartedOutsideDistributed(RuntimeError):
    """A test not marked `distributed` started a process or a process group."""


_VIOLATIONS = pytest.StashKey[list]()


def _entry_points():
    """(owner, attribute, what) of every way a test starts a process or a process group."""
    import _posixsubprocess
    import multiprocessing.process
    import os
    import subprocess

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    points = [
        (subprocess.Popen, "_execute_child", "a subprocess (subprocess.Popen/run)"),
        (_posixsubprocess, "fork_exec", "a process (fork_exec)"),
        (multiprocessing.process.BaseProcess, "start", "a multiprocessing process"),
        (dist, "init_process_group", "a process group (torch.distributed.init_process_group)"),
        (c10d, "init_process_group", "a process group (torch.distributed.init_process_group)"),
    ]
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            points.append((os, name, f"a process (os.{name})"))
    return points


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of a test not marked `distributed` run with every entry point of
    `_entry_points` replaced by one that raises (and records, for code that swallows the error)."""
    if item.get_closest_marker("distributed") is not None:
        return (yield)
    found = item.stash.setdefault(_VIOLATIONS, [])

    def refuse(what):
        def refused(*args, **kwargs):
            message = (
                f"{item.nodeid} started {what} but is not marked `distributed`: mark it "
                "@pytest.mark.distributed (or the module's pytestmark), or keep the fast lane process-free"
            )
            found.append(message)
            raise StartedOutsideDistributed(message)

        return refused

    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in _entry_points():
            patch.setattr(owner, name, refuse(what))
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase in which the guard refused a process fails, whatever the code under test did with the error."""
    report = yield
    found = item.stash.get(_VIOLATIONS, [])
    if found:
        if not report.failed or hasattr(report, "wasxfail"):  # swallowed, or taken for an expected failure
            report.outcome = "failed"
            report.longrepr = "\n".join(dict.fromkeys(found))
            if hasattr(report, "wasxfail"):
                del report.wasxfail
        found.clear()
    return report
